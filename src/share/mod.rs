//! Sharing datasets between processes over a Unix socket.
//!
//! The producer exports a shareable dataset's physical memory as a POSIX file descriptor and
//! sends it with SCM_RIGHTS, together with an [`Offer`] describing it. The consumer checks the
//! offer against its own space (layout fingerprint, group, size, device), imports the memory, and
//! gets a [`Dataset`] it binds under its own stable slot addresses: a graph captured over its
//! slots replays on the producer's data with no copy. The memory lives as long as any process
//! holds it, so the consumer's copy stays valid after the producer exits.
//!
//! ```text
//!  producer                                  consumer
//!  send_dataset ── Offer + fd (SCM_RIGHTS) ─▶ receive_dataset: check, import, (Reject on mismatch)
//!  wait_ack    ◀── Ack { dataset } ────────── send_ack
//! ```
//!
//! The wire format is in [`protocol`]. [`publish`] shares a region's weight sets the same way
//! (RL weight sync: a trainer writes into an engine's spare set, the engine binds it).

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use crate::dataset::Dataset;
use crate::driver::share::{receive_with_fds, send_with_fd};
use crate::driver::vmm::Physical;
use crate::error::{Error, LayoutError, Result, ShareError};
use crate::space::Space;

pub use crate::error::ProtocolError;
pub use protocol::{Message, Offer, MAX_MESSAGE, PROTOCOL_VERSION};

pub mod protocol;
pub mod publish;

#[cfg(test)]
mod fuzz;

impl Offer {
    /// Whether a space of `layout` placed as `placement` on the device `uuid` can take this
    /// offer; returns the offered group's index.
    pub fn check(
        &self,
        layout: &crate::layout::Layout,
        placement: &crate::layout::Placement,
        uuid: [u8; 16],
    ) -> Result<usize> {
        if self.device_uuid != uuid {
            return Err(Error::Share(ShareError::DeviceMismatch {
                expected: uuid,
                found: self.device_uuid,
            }));
        }
        let mismatch = || {
            Error::Layout(LayoutError::LayoutMismatch {
                group: self.group.clone(),
                dataset_layout: self.layout_fingerprint,
                space_layout: layout.fingerprint(),
            })
        };
        let index = placement.group_index(&self.group).map_err(|_| mismatch())?;
        if self.layout_fingerprint != layout.fingerprint()
            || self.bytes != placement.groups[index].bytes as u64
        {
            return Err(mismatch());
        }
        Ok(index)
    }
}

/// Sends `message` with an optional descriptor.
pub fn send_message(socket: &UnixStream, message: &Message, fd: Option<&OwnedFd>) -> Result<()> {
    send_with_fd(socket, &message.frame(), fd)
}

/// Reads one framed message and the descriptors that came with it.
pub fn receive_message(socket: &UnixStream) -> Result<(Message, Vec<OwnedFd>)> {
    let (body, fds) = receive_frame(socket)?;
    Ok((Message::decode(&body)?, fds))
}

/// Reads one frame's body (undecoded) and the descriptors that came with it.
pub(crate) fn receive_frame(socket: &UnixStream) -> Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut fds = Vec::new();
    let mut header = [0u8; 4];
    read_exact(socket, &mut header, &mut fds, true)?;
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_MESSAGE {
        return Err(ProtocolError::TooLarge(len).into());
    }
    let mut body = vec![0u8; len];
    read_exact(socket, &mut body, &mut fds, false)?;
    Ok((body, fds))
}

/// Fills `buffer`. The peer closing before the first byte is [`ProtocolError::Closed`] when
/// `frame_start` (nothing of a frame has arrived yet), and truncation anywhere else.
fn read_exact(
    socket: &UnixStream,
    buffer: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    frame_start: bool,
) -> Result<()> {
    let mut at = 0;
    while at < buffer.len() {
        let (n, received) = receive_with_fds(socket, &mut buffer[at..])?;
        fds.extend(received);
        if n == 0 {
            return Err(if frame_start && at == 0 && fds.is_empty() {
                ProtocolError::Closed
            } else {
                ProtocolError::Truncated {
                    needed: buffer.len(),
                    got: at,
                }
            }
            .into());
        }
        at += n;
    }
    Ok(())
}

/// Exports `dataset` (created with
/// [`SpaceOptions::shareable`](crate::SpaceOptions::shareable)) and sends it as an offer. The
/// descriptor is closed here once sent; the peer holds its own.
pub fn send_dataset(socket: &UnixStream, dataset: &Dataset) -> Result<()> {
    let fd = dataset.export()?;
    let offer = Offer {
        layout_fingerprint: dataset.layout_fingerprint(),
        group: dataset.group().to_string(),
        bytes: dataset.bytes() as u64,
        granularity: crate::driver::vmm::granularity(dataset.context(), true)? as u64,
        device_uuid: device_uuid(dataset.context())?,
        dataset: dataset.id(),
    };
    send_message(socket, &Message::Offer(offer), Some(&fd))
}

/// Receives an offer and imports it as a dataset of `space`'s layout, ready to bind. A mismatch
/// (layout, group, size, device) is refused with a typed error and a Reject sent to the peer;
/// every received descriptor is closed in all cases.
pub fn receive_dataset(socket: &UnixStream, space: &Space) -> Result<(Dataset, Offer)> {
    let (message, mut fds) = receive_message(socket)?;
    let offer = match message {
        Message::Offer(offer) => offer,
        Message::Reject { reason } => return Err(Error::Share(ShareError::Rejected { reason })),
        Message::Ack { .. } => {
            return Err(ProtocolError::Unexpected {
                expected: "an offer",
            }
            .into())
        }
    };
    let fd = match (fds.pop(), fds.len()) {
        (Some(fd), 0) => fd,
        (None, _) => return Err(ProtocolError::MissingFd.into()),
        (Some(_), extra) => return Err(ProtocolError::UnexpectedFds { count: extra + 1 }.into()),
    };
    match check_and_import(space, &offer, &fd) {
        Ok(dataset) => Ok((dataset, offer)),
        Err(error) => {
            // Tell the producer why; a failure to tell it must not hide the real error.
            let _ = send_message(
                socket,
                &Message::Reject {
                    reason: error.to_string(),
                },
                None,
            );
            Err(error)
        }
    }
}

fn check_and_import(space: &Space, offer: &Offer, fd: &OwnedFd) -> Result<Dataset> {
    let ctx = space.context();
    let index = offer.check(space.layout(), space.placement(), device_uuid(ctx)?)?;
    let region = &space.placement().groups[index];
    let physical = Physical::import(ctx, fd, region.bytes)?;
    Dataset::from_physical(
        ctx,
        space.layout(),
        space.placement(),
        index,
        &[ctx.ordinal()],
        physical,
    )
}

/// Acknowledges dataset `dataset` (the offer's id) to the producer.
pub fn send_ack(socket: &UnixStream, dataset: u64) -> Result<()> {
    send_message(socket, &Message::Ack { dataset }, None)
}

/// Waits for the consumer's answer about `dataset`: `Ok` on its Ack,
/// [`ShareError::Rejected`] with the
/// consumer's reason on a Reject.
pub fn wait_ack(socket: &UnixStream, dataset: u64) -> Result<()> {
    match receive_message(socket)?.0 {
        Message::Ack { dataset: acked } if acked == dataset => Ok(()),
        Message::Reject { reason } => Err(Error::Share(ShareError::Rejected { reason })),
        _ => Err(ProtocolError::Unexpected {
            expected: "an ack for this dataset",
        }
        .into()),
    }
}

pub(crate) fn device_uuid(ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<[u8; 16]> {
    let uuid = crate::driver::traced("cuDeviceGetUuid", 0, || ctx.uuid())?;
    Ok(uuid.bytes.map(|b| b as u8))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> Offer {
        Offer {
            layout_fingerprint: 0x1234_5678_9abc_def0,
            group: "weights".into(),
            bytes: 6 << 20,
            granularity: 2 << 20,
            device_uuid: [7; 16],
            dataset: 42,
        }
    }

    #[test]
    fn every_message_round_trips() {
        for m in [
            Message::Offer(offer()),
            Message::Ack { dataset: 9 },
            Message::Reject {
                reason: "layout ≠".into(),
            },
        ] {
            assert_eq!(Message::decode(&m.encode()), Ok(m.clone()));
            let frame = m.frame();
            assert_eq!(
                u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize,
                frame.len() - 4
            );
        }
    }

    #[test]
    fn offers_for_another_layout_group_size_or_device_are_refused() {
        let layout = crate::layout::Layout::builder()
            .group("weights")
            .input("w", 5 << 20)
            .build()
            .unwrap();
        let placement = layout.place(2 << 20).unwrap();
        let good = Offer {
            layout_fingerprint: layout.fingerprint(),
            bytes: 6 << 20,
            ..offer()
        };
        assert_eq!(good.check(&layout, &placement, [7; 16]).unwrap(), 0);
        let cases = [
            Offer {
                layout_fingerprint: 1,
                ..good.clone()
            },
            Offer {
                group: "other".into(),
                ..good.clone()
            },
            Offer {
                bytes: 4 << 20,
                ..good.clone()
            },
        ];
        for bad in cases {
            assert!(
                matches!(
                    bad.check(&layout, &placement, [7; 16]),
                    Err(Error::Layout(LayoutError::LayoutMismatch { .. }))
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            good.check(&layout, &placement, [8; 16]),
            Err(Error::Share(ShareError::DeviceMismatch { .. }))
        ));
    }

    #[test]
    fn every_truncation_is_reported_not_misread() {
        let bytes = Message::Offer(offer()).encode();
        for cut in 0..bytes.len() {
            assert!(
                matches!(
                    Message::decode(&bytes[..cut]),
                    Err(ProtocolError::Truncated { .. })
                ),
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn foreign_and_future_messages_are_refused() {
        let mut bytes = Message::Ack { dataset: 1 }.encode();
        bytes[0] = b'X';
        assert_eq!(Message::decode(&bytes), Err(ProtocolError::BadMagic));
        let mut bytes = Message::Ack { dataset: 1 }.encode();
        bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
        assert_eq!(
            Message::decode(&bytes),
            Err(ProtocolError::Version {
                got: 2,
                supported: 1
            })
        );
        let mut bytes = Message::Ack { dataset: 1 }.encode();
        bytes[6] = 99;
        assert_eq!(Message::decode(&bytes), Err(ProtocolError::UnknownKind(99)));
        let mut bytes = Message::Reject {
            reason: "ab".into(),
        }
        .encode();
        let n = bytes.len();
        bytes[n - 1] = 0xff;
        assert_eq!(Message::decode(&bytes), Err(ProtocolError::BadUtf8));
    }

    #[test]
    fn framed_messages_cross_a_socket_with_and_without_fds() {
        let (a, b) = UnixStream::pair().unwrap();
        send_message(&a, &Message::Ack { dataset: 5 }, None).unwrap();
        let (m, fds) = receive_message(&b).unwrap();
        assert_eq!(m, Message::Ack { dataset: 5 });
        assert!(fds.is_empty());

        // A descriptor travels with an offer (a pipe stands in for CUDA memory here).
        let (read, _write) = std::io::pipe().unwrap();
        let fd: OwnedFd = read.into();
        send_message(&a, &Message::Offer(offer()), Some(&fd)).unwrap();
        let (m, fds) = receive_message(&b).unwrap();
        assert_eq!(m, Message::Offer(offer()));
        assert_eq!(fds.len(), 1);

        // Malformed and closed peers are typed errors.
        std::io::Write::write_all(&mut &a, &[5, 0, 0, 0, b'n', b'o', b'p', b'e', b'!']).unwrap();
        assert!(matches!(
            receive_message(&b),
            Err(Error::Share(ShareError::Protocol(ProtocolError::BadMagic)))
        ));
        std::io::Write::write_all(&mut &a, &[200, 0, 0, 0, b'S']).unwrap();
        drop(a);
        assert!(matches!(
            receive_message(&b),
            Err(Error::Share(ShareError::Protocol(
                ProtocolError::Truncated { .. }
            )))
        ));
        assert!(matches!(
            receive_message(&b),
            Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
        ));
    }

    #[test]
    fn a_peer_dying_with_our_reply_unread_reads_as_truncated_then_closed() {
        let (a, b) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut &a, &[64, 0, 0, 0, b'S', b'B']).unwrap();
        // `b` answers; `a` never reads it and goes away (Linux then resets the connection).
        send_message(
            &b,
            &Message::Reject {
                reason: "no".into(),
            },
            None,
        )
        .unwrap();
        drop(a);
        assert!(matches!(
            receive_message(&b),
            Err(Error::Share(ShareError::Protocol(
                ProtocolError::Truncated { .. }
            )))
        ));
        assert!(matches!(
            receive_message(&b),
            Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
        ));
    }

    #[test]
    fn oversized_frames_are_refused_before_allocation() {
        let (a, b) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut &a, &u32::MAX.to_le_bytes()).unwrap();
        assert!(matches!(
            receive_message(&b),
            Err(Error::Share(ShareError::Protocol(ProtocolError::TooLarge(
                _
            ))))
        ));
    }
}
