//! Publishing a region's weight sets to another process: the RL weight-sync path.
//!
//! The engine (the process serving with captured graphs) makes spare weight sets of its region
//! with [`Region::snapshot_shareable`](crate::region::Region::snapshot_shareable) and offers
//! each to a trainer with [`offer_weight_set`]: the set's file descriptor rides along
//! (SCM_RIGHTS). The trainer imports each with [`receive_weight_set`] (checked against what it
//! expects: device, tag, layout fingerprint, size), maps it read-write, writes new weights into
//! it, synchronises its own stream and sends [`PublishMessage::Commit`]. The engine binds a
//! committed set (one remap, its graphs replay on it) and hands the set it replaced back with
//! [`PublishMessage::Released`]: two spares make a double buffer.
//!
//! ```text
//!  engine                                         trainer
//!  offer_weight_set ── Offer + fd (per set) ────▶ receive_weight_set: check, import, map
//!  wait_set_ack    ◀── Ack { set } / Reject ──── (Reject names the first mismatch)
//!  send_manifest   ── Manifest (text, chunked) ─▶ receive_manifest
//!                                                 write set S, synchronise its stream
//!  receive_message ◀── Commit { set S, version } ─
//!  bind S (one remap); graphs replay on it
//!  send Released { the set S replaced } ────────▶ may write that one next
//! ```
//!
//! Frames are those of [`share`](super) (length prefix, at most
//! [`MAX_MESSAGE`](super::MAX_MESSAGE)); the body starts with its own magic `SBWS`, so a
//! dataset message sent here (or the reverse) is refused as [`ProtocolError::BadMagic`].
//! A set is only ever bound after its Commit, and a trainer commits only after its writes are
//! done: the engine never serves half-written weights. If the trainer dies, its socket closes
//! ([`ProtocolError::Closed`]) and the engine keeps serving the set it has bound.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::protocol::{frame, put_string, Reader, MAX_STRING};
use super::{device_uuid, receive_frame};
use crate::driver::share::send_with_fd;
use crate::error::{Error, ProtocolError, Result, ShareError};
use crate::region::Snapshot;

const MAGIC: &[u8; 4] = b"SBWS";
/// The version of the weight-publish messages this build speaks.
pub const PUBLISH_VERSION: u16 = 1;

/// Describes one weight set offered to another process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SetOffer {
    /// The engine's id for the set (named again in Ack, Commit and Released).
    pub set: u64,
    /// The tag of the region the set backs.
    pub tag: String,
    /// A fingerprint of the set's layout (the Python package: of its manifest; Rust:
    /// [`Region::layout_fingerprint`](crate::region::Region::layout_fingerprint)).
    pub layout_fingerprint: u64,
    /// Bytes of physical memory behind the descriptor.
    pub bytes: u64,
    /// The engine's allocation granularity for exportable memory (informative).
    pub granularity: u64,
    /// `cuDeviceGetUuid` of the engine's device.
    pub device_uuid: [u8; 16],
}

/// What an importer expects of an offer; `None` fields are not checked. The device always is.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Expectation {
    /// The region tag.
    pub tag: Option<String>,
    /// The layout fingerprint.
    pub layout_fingerprint: Option<u64>,
    /// The set's size in bytes.
    pub bytes: Option<u64>,
}

impl SetOffer {
    /// `Ok` if the offer is what `expect` describes and lives on the device `uuid`; otherwise
    /// the first difference, in the order device, tag, layout fingerprint, bytes.
    pub fn check(&self, expect: &Expectation, uuid: [u8; 16]) -> Result<()> {
        if self.device_uuid != uuid {
            return Err(Error::Share(ShareError::DeviceMismatch {
                expected: uuid,
                found: self.device_uuid,
            }));
        }
        let differs = |what, expected: String, found: String| {
            Error::Share(ShareError::OfferMismatch {
                what,
                expected,
                found,
            })
        };
        if let Some(tag) = expect.tag.as_ref().filter(|t| **t != self.tag) {
            return Err(differs("tag", tag.clone(), self.tag.clone()));
        }
        if let Some(fp) = expect
            .layout_fingerprint
            .filter(|f| *f != self.layout_fingerprint)
        {
            return Err(differs(
                "layout fingerprint",
                format!("{fp:016x}"),
                format!("{:016x}", self.layout_fingerprint),
            ));
        }
        if let Some(bytes) = expect.bytes.filter(|b| *b != self.bytes) {
            return Err(differs("bytes", bytes.to_string(), self.bytes.to_string()));
        }
        Ok(())
    }
}

/// One message of the weight-publish exchange.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PublishMessage {
    /// Engine → trainer: a weight set; its descriptor rides along.
    Offer(SetOffer),
    /// Trainer → engine: the set was checked and imported.
    Ack {
        /// The set's id.
        set: u64,
    },
    /// Either way: refused (an offer that does not match; a second trainer; a stale version).
    Reject {
        /// Why, in words.
        reason: String,
    },
    /// Trainer → engine: the set holds weights of `version`, completely written.
    Commit {
        /// The set's id.
        set: u64,
        /// The trainer's version number (increasing).
        version: u64,
    },
    /// Engine → trainer: the set is no longer bound; the trainer may write it.
    Released {
        /// The set's id.
        set: u64,
    },
    /// Engine → trainer: a part of the manifest text; `more` while parts follow.
    Manifest {
        /// The text of this part.
        text: String,
        /// Whether another part follows.
        more: bool,
    },
}

impl PublishMessage {
    /// The message body (without the length prefix).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&PUBLISH_VERSION.to_le_bytes());
        let u64s = |out: &mut Vec<u8>, kind: u8, values: &[u64]| {
            out.push(kind);
            values
                .iter()
                .for_each(|v| out.extend_from_slice(&v.to_le_bytes()));
        };
        match self {
            PublishMessage::Offer(o) => {
                u64s(&mut out, 1, &[o.set]);
                put_string(&mut out, &o.tag);
                out.extend_from_slice(&o.layout_fingerprint.to_le_bytes());
                out.extend_from_slice(&o.bytes.to_le_bytes());
                out.extend_from_slice(&o.granularity.to_le_bytes());
                out.extend_from_slice(&o.device_uuid);
            }
            PublishMessage::Ack { set } => u64s(&mut out, 2, &[*set]),
            PublishMessage::Reject { reason } => {
                out.push(3);
                put_string(&mut out, reason);
            }
            PublishMessage::Commit { set, version } => u64s(&mut out, 4, &[*set, *version]),
            PublishMessage::Released { set } => u64s(&mut out, 5, &[*set]),
            PublishMessage::Manifest { text, more } => {
                out.push(6);
                put_string(&mut out, text);
                out.push(u8::from(*more));
            }
        }
        out
    }

    /// Parses a body; only the exact bytes [`PublishMessage::encode`] writes are accepted.
    pub fn decode(bytes: &[u8]) -> std::result::Result<Self, ProtocolError> {
        let mut r = Reader::new(bytes);
        r.header(MAGIC, PUBLISH_VERSION)?;
        let message = match r.u8()? {
            1 => PublishMessage::Offer(SetOffer {
                set: r.u64()?,
                tag: r.string()?,
                layout_fingerprint: r.u64()?,
                bytes: r.u64()?,
                granularity: r.u64()?,
                device_uuid: r.take(16)?.try_into().expect("16 bytes"),
            }),
            2 => PublishMessage::Ack { set: r.u64()? },
            3 => PublishMessage::Reject {
                reason: r.string()?,
            },
            4 => PublishMessage::Commit {
                set: r.u64()?,
                version: r.u64()?,
            },
            5 => PublishMessage::Released { set: r.u64()? },
            6 => PublishMessage::Manifest {
                text: r.string()?,
                more: match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(ProtocolError::UnknownKind(6)),
                },
            },
            other => return Err(ProtocolError::UnknownKind(other)),
        };
        match r.remaining() {
            0 => Ok(message),
            extra => Err(ProtocolError::TrailingBytes { extra }),
        }
    }

    /// Length prefix (`u32`, little-endian) + body, as [`Message::frame`](super::Message::frame).
    pub fn frame(&self) -> Vec<u8> {
        frame(&self.encode())
    }
}

/// Sends `message`, with `fd` riding along if given.
pub fn send(socket: &UnixStream, message: &PublishMessage, fd: Option<&OwnedFd>) -> Result<()> {
    send_with_fd(socket, &message.frame(), fd)
}

/// Reads one message and the descriptors that came with it (owned: closed when dropped).
pub fn receive(socket: &UnixStream) -> Result<(PublishMessage, Vec<OwnedFd>)> {
    let (body, fds) = receive_frame(socket)?;
    Ok((PublishMessage::decode(&body)?, fds))
}

/// Reads one message that must come without descriptors (any that came are closed).
pub fn receive_plain(socket: &UnixStream) -> Result<PublishMessage> {
    let (message, fds) = receive(socket)?;
    if !fds.is_empty() {
        return Err(ProtocolError::UnexpectedFds { count: fds.len() }.into());
    }
    Ok(message)
}

/// Whether a message (or the peer's close) is waiting to be read: a later [`receive`] then
/// does not block for long. Never blocks.
pub fn message_waiting(socket: &UnixStream) -> Result<bool> {
    use nix::sys::socket::{recv, MsgFlags};
    use std::os::fd::AsRawFd;
    let mut byte = [0u8; 1];
    let flags = MsgFlags::MSG_PEEK | MsgFlags::MSG_DONTWAIT;
    match recv(socket.as_raw_fd(), &mut byte, flags) {
        Ok(_) => Ok(true), // 0 bytes: the peer closed, which `receive` reports
        Err(nix::errno::Errno::EAGAIN) => Ok(false),
        Err(nix::errno::Errno::ECONNRESET) => Ok(true),
        Err(e) => Err(Error::Io {
            call: "recv",
            source: std::io::Error::from_raw_os_error(e as i32),
        }),
    }
}

/// Exports `snapshot` (made with
/// [`Region::snapshot_shareable`](crate::region::Region::snapshot_shareable)) and offers it as
/// set `snapshot.id()` of region `tag`. Our copy of the descriptor closes once sent.
pub fn offer_weight_set(
    socket: &UnixStream,
    snapshot: &Snapshot,
    tag: &str,
    layout_fingerprint: u64,
    ctx: &Arc<CudaContext>,
) -> Result<SetOffer> {
    let fd = snapshot.export()?;
    let offer = SetOffer {
        set: snapshot.id(),
        tag: tag.to_string(),
        layout_fingerprint,
        bytes: snapshot.bytes() as u64,
        granularity: crate::driver::vmm::granularity(ctx, true)? as u64,
        device_uuid: device_uuid(ctx)?,
    };
    send(socket, &PublishMessage::Offer(offer.clone()), Some(&fd))?;
    tracing::debug!(
        set = offer.set,
        tag,
        bytes = offer.bytes,
        "weight set offered"
    );
    Ok(offer)
}

/// Waits for the trainer's answer to the offer of `set`: `Ok` on its Ack,
/// [`ShareError::Rejected`] with its reason on a Reject.
pub fn wait_set_ack(socket: &UnixStream, set: u64) -> Result<()> {
    match receive_plain(socket)? {
        PublishMessage::Ack { set: acked } if acked == set => Ok(()),
        PublishMessage::Reject { reason } => Err(Error::Share(ShareError::Rejected { reason })),
        _ => Err(ProtocolError::Unexpected {
            expected: "an ack of the offered weight set",
        }
        .into()),
    }
}

/// Receives one offer, checks it against `expect` and `ctx`'s device, imports it and maps it
/// read-write ([`Snapshot::home_ptr`]), then acknowledges it. On a mismatch nothing is imported,
/// a Reject naming the difference goes to the engine and the typed error is returned. Every
/// descriptor received is closed before returning, in all cases.
pub fn receive_weight_set(
    socket: &UnixStream,
    ctx: &Arc<CudaContext>,
    expect: &Expectation,
) -> Result<(Snapshot, SetOffer)> {
    receive_weight_set_for(socket, ctx, expect, &[ctx.ordinal()])
}

/// [`receive_weight_set`] mapping the set for every device of `access` (ordinals; `ctx`'s
/// device, where the memory lives, first): a trainer on a peer GPU then writes into it over
/// NVLink. An empty list means `ctx`'s device alone.
pub fn receive_weight_set_for(
    socket: &UnixStream,
    ctx: &Arc<CudaContext>,
    expect: &Expectation,
    access: &[usize],
) -> Result<(Snapshot, SetOffer)> {
    let own = [ctx.ordinal()];
    let access = if access.is_empty() { &own[..] } else { access };
    let (message, mut fds) = receive(socket)?;
    let offer = match message {
        PublishMessage::Offer(offer) => offer,
        PublishMessage::Reject { reason } => {
            return Err(Error::Share(ShareError::Rejected { reason }))
        }
        _ => {
            return Err(ProtocolError::Unexpected {
                expected: "a weight set offer",
            }
            .into())
        }
    };
    let fd = match (fds.pop(), fds.len()) {
        (Some(fd), 0) => fd,
        (None, _) => return Err(ProtocolError::MissingFd.into()),
        (Some(_), extra) => return Err(ProtocolError::UnexpectedFds { count: extra + 1 }.into()),
    };
    let imported = device_uuid(ctx)
        .and_then(|uuid| offer.check(expect, uuid))
        .and_then(|()| Snapshot::import(ctx, &fd, offer.bytes as usize, access))
        .and_then(|snapshot| snapshot.home_ptr().map(|_| snapshot));
    drop(fd); // the imported handle keeps the memory alive by itself
    match imported {
        Ok(snapshot) => {
            send(socket, &PublishMessage::Ack { set: offer.set }, None)?;
            tracing::debug!(set = offer.set, tag = %offer.tag, bytes = offer.bytes, "weight set imported");
            Ok((snapshot, offer))
        }
        Err(error) => {
            tracing::warn!(set = offer.set, %error, "weight set offer refused");
            // Tell the engine why; a failure to tell it must not hide the real error.
            let reason = error.to_string();
            let _ = send(socket, &PublishMessage::Reject { reason }, None);
            Err(error)
        }
    }
}

/// Sends `text` (a manifest: parameter names, offsets, shapes) in parts that each fit a frame.
pub fn send_manifest(socket: &UnixStream, text: &str) -> Result<()> {
    let parts = split_text(text, MAX_STRING);
    let last = parts.len() - 1;
    for (i, part) in parts.into_iter().enumerate() {
        let message = PublishMessage::Manifest {
            text: part.to_string(),
            more: i < last,
        };
        send(socket, &message, None)?;
    }
    Ok(())
}

/// Receives a manifest sent with [`send_manifest`], however many parts it took.
pub fn receive_manifest(socket: &UnixStream) -> Result<String> {
    let mut text = String::new();
    loop {
        match receive_plain(socket)? {
            PublishMessage::Manifest { text: part, more } => {
                text.push_str(&part);
                if !more {
                    return Ok(text);
                }
            }
            PublishMessage::Reject { reason } => {
                return Err(Error::Share(ShareError::Rejected { reason }))
            }
            _ => {
                return Err(ProtocolError::Unexpected {
                    expected: "a manifest",
                }
                .into())
            }
        }
    }
}

/// `text` cut into parts of at most `limit` bytes, each on character boundaries; at least one
/// (empty) part.
fn split_text(text: &str, limit: usize) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut rest = text;
    while rest.len() > limit {
        let mut end = limit;
        while !rest.is_char_boundary(end) {
            end -= 1;
        }
        parts.push(&rest[..end]);
        rest = &rest[end..];
    }
    parts.push(rest);
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn offer() -> SetOffer {
        SetOffer {
            set: 7,
            tag: "weights".into(),
            layout_fingerprint: 0xfeed_f00d,
            bytes: 8 << 20,
            granularity: 2 << 20,
            device_uuid: [3; 16],
        }
    }

    #[test]
    fn every_message_round_trips_and_every_cut_is_truncation() {
        for m in [
            PublishMessage::Offer(offer()),
            PublishMessage::Ack { set: 1 },
            PublishMessage::Reject {
                reason: "nope ≠".into(),
            },
            PublishMessage::Commit { set: 2, version: 9 },
            PublishMessage::Released { set: 3 },
            PublishMessage::Manifest {
                text: "{\"a\": 1}".into(),
                more: true,
            },
        ] {
            let bytes = m.encode();
            assert_eq!(PublishMessage::decode(&bytes), Ok(m.clone()));
            for cut in 0..bytes.len() {
                assert!(
                    matches!(
                        PublishMessage::decode(&bytes[..cut]),
                        Err(ProtocolError::Truncated { .. })
                    ),
                    "{m:?} cut at {cut}"
                );
            }
            let mut longer = bytes.clone();
            longer.push(0);
            assert_eq!(
                PublishMessage::decode(&longer),
                Err(ProtocolError::TrailingBytes { extra: 1 })
            );
        }
    }

    #[test]
    fn both_protocols_frame_as_length_then_body() {
        let ack = PublishMessage::Ack { set: 1 };
        let body = ack.encode();
        let mut expected = (body.len() as u32).to_le_bytes().to_vec();
        expected.extend_from_slice(&body);
        assert_eq!(ack.frame(), expected);
        let message = crate::share::Message::Ack { dataset: 4 };
        let body = message.encode();
        assert_eq!(message.frame()[..4], (body.len() as u32).to_le_bytes());
        assert_eq!(message.frame()[4..], body[..]);
    }

    proptest::proptest! {
        #![proptest_config(crate::testing::proptest_config(256))]

        /// Any bytes after a valid header decode to a message or a typed error, never a panic;
        /// whatever decodes re-encodes to the same bytes.
        #[test]
        fn random_bodies_decode_or_fail_cleanly(kind in 0u8..8, tail in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..80)) {
            let mut body = MAGIC.to_vec();
            body.extend_from_slice(&PUBLISH_VERSION.to_le_bytes());
            body.push(kind);
            body.extend(tail);
            if let Ok(message) = PublishMessage::decode(&body) {
                proptest::prop_assert_eq!(message.encode(), body);
            }
        }
    }

    #[test]
    fn dataset_messages_and_foreign_kinds_are_refused() {
        let dataset = super::super::Message::Ack { dataset: 1 }.encode();
        assert_eq!(
            PublishMessage::decode(&dataset),
            Err(ProtocolError::BadMagic)
        );
        let mut bytes = PublishMessage::Ack { set: 1 }.encode();
        bytes[6] = 42;
        assert_eq!(
            PublishMessage::decode(&bytes),
            Err(ProtocolError::UnknownKind(42))
        );
        let mut bytes = PublishMessage::Ack { set: 1 }.encode();
        bytes[4] = 9;
        assert!(matches!(
            PublishMessage::decode(&bytes),
            Err(ProtocolError::Version { got: 9, .. })
        ));
    }

    #[test]
    fn offers_name_the_first_mismatch() {
        let good = Expectation {
            tag: Some("weights".into()),
            layout_fingerprint: Some(0xfeed_f00d),
            bytes: Some(8 << 20),
        };
        offer().check(&good, [3; 16]).unwrap();
        offer().check(&Expectation::default(), [3; 16]).unwrap();
        assert!(matches!(
            offer().check(&good, [4; 16]),
            Err(Error::Share(ShareError::DeviceMismatch { .. }))
        ));
        let what = |expect: Expectation| match offer().check(&expect, [3; 16]) {
            Err(Error::Share(ShareError::OfferMismatch { what, .. })) => what,
            other => panic!("{other:?}"),
        };
        let wrong_tag = Expectation {
            tag: Some("kv".into()),
            bytes: Some(1),
            ..good.clone()
        };
        assert_eq!(what(wrong_tag), "tag");
        let wrong_fingerprint = Expectation {
            layout_fingerprint: Some(1),
            bytes: Some(1),
            ..good.clone()
        };
        assert_eq!(what(wrong_fingerprint), "layout fingerprint");
        assert_eq!(
            what(Expectation {
                bytes: Some(1),
                ..good
            }),
            "bytes"
        );
    }

    #[test]
    fn manifests_of_any_size_cross_a_socket_in_parts() {
        let (a, b) = UnixStream::pair().unwrap();
        let text: String = (0..40_000).map(|i| format!("p{i}é,")).collect();
        assert!(text.len() > 3 * MAX_STRING);
        let sender = std::thread::spawn(move || send_manifest(&a, &text).map(|()| text));
        let got = receive_manifest(&b).unwrap();
        assert_eq!(got, sender.join().unwrap().unwrap());
        for part in split_text("aé", 2) {
            assert!(part.len() <= 2);
        }
        assert_eq!(split_text("", 5), [""]);
    }

    #[test]
    fn waiting_messages_and_closes_are_seen_without_blocking() {
        let (a, b) = UnixStream::pair().unwrap();
        assert!(!message_waiting(&b).unwrap());
        send(&a, &PublishMessage::Commit { set: 1, version: 2 }, None).unwrap();
        assert!(message_waiting(&b).unwrap());
        assert_eq!(
            receive_plain(&b).unwrap(),
            PublishMessage::Commit { set: 1, version: 2 }
        );
        drop(a);
        assert!(message_waiting(&b).unwrap());
        assert!(matches!(
            receive_plain(&b),
            Err(Error::Share(ShareError::Protocol(ProtocolError::Closed)))
        ));
    }
}
