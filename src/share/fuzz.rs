//! Fuzzing the wire protocol: random and mutated bodies through [`Message::decode`], random
//! streams of frames (with descriptors) through [`receive_message`] over a socket pair. The
//! properties: nothing panics, every failure is a typed [`ProtocolError`], decoding accepts only
//! what [`Message::encode`] writes (so a decoded message re-encodes to the same bytes), every
//! message round-trips, and every received descriptor is closed.

use std::io::PipeWriter;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

use super::protocol::{clip, Message, Offer, MAX_MESSAGE, MAX_STRING, PROTOCOL_VERSION};
use super::{receive_message, send_message};
use crate::error::{Error, ProtocolError, ShareError};

/// Cases per property; the four properties together run 100,000 (in a few seconds).
const DECODE_CASES: u32 = 40_000;
const MUTATION_CASES: u32 = 40_000;
const ROUND_TRIP_CASES: u32 = 18_000;
const STREAM_CASES: u32 = 2_000;

fn runner(cases: u32) -> TestRunner {
    TestRunner::new(Config {
        failure_persistence: None,
        ..crate::testing::proptest_config(cases)
    })
}

/// Runs `test` over `cases` values of `strategy`; panics with the smallest failing input.
fn fuzz<S: Strategy>(
    name: &str,
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value) -> Result<(), TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    if let Err(failure) = runner(cases).run(&strategy, test) {
        panic!("{name}: {failure}");
    }
    eprintln!("{name}: {cases} cases");
}

/// Short strings of any characters, and now and then one around [`MAX_STRING`] bytes made of
/// multi-byte characters, so the cut lands on and inside character boundaries.
fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        20 => ".{0,24}",
        1 => (prop::sample::select(vec!['a', 'é', '€', '𝄞']), 0usize..8).prop_map(|(c, extra)| {
            let n = MAX_STRING / c.len_utf8() + extra;
            std::iter::repeat_n(c, n).collect::<String>()
        }),
    ]
}

fn offer() -> impl Strategy<Value = Offer> {
    (
        any::<u64>(),
        text(),
        any::<u64>(),
        any::<u64>(),
        any::<[u8; 16]>(),
        any::<u64>(),
    )
        .prop_map(
            |(layout_fingerprint, group, bytes, granularity, device_uuid, dataset)| Offer {
                layout_fingerprint,
                group,
                bytes,
                granularity,
                device_uuid,
                dataset,
            },
        )
}

fn message() -> impl Strategy<Value = Message> {
    prop_oneof![
        offer().prop_map(Message::Offer),
        any::<u64>().prop_map(|dataset| Message::Ack { dataset }),
        text().prop_map(|reason| Message::Reject { reason }),
    ]
}

/// What the peer receives for `message`: its strings clipped to [`MAX_STRING`].
fn as_received(message: &Message) -> Message {
    match message {
        Message::Offer(offer) => Message::Offer(Offer {
            group: clip(&offer.group).to_string(),
            ..offer.clone()
        }),
        Message::Reject { reason } => Message::Reject {
            reason: clip(reason).to_string(),
        },
        ack => ack.clone(),
    }
}

/// The properties every decode must have, whatever the bytes.
fn check_decode(bytes: &[u8]) -> Result<(), TestCaseError> {
    match Message::decode(bytes) {
        Ok(message) => prop_assert_eq!(
            message.encode(),
            bytes,
            "decoded bytes that are not the message's encoding"
        ),
        Err(ProtocolError::Truncated { needed, got }) => {
            prop_assert_eq!(got, bytes.len());
            prop_assert!(needed > got, "truncated, yet {} of {} present", got, needed);
        }
        Err(ProtocolError::TrailingBytes { extra }) => {
            prop_assert!(extra > 0 && extra < bytes.len());
        }
        Err(ProtocolError::StringTooLong { bytes }) => prop_assert!(bytes > MAX_STRING),
        Err(
            ProtocolError::BadMagic
            | ProtocolError::Version { .. }
            | ProtocolError::UnknownKind(_)
            | ProtocolError::BadUtf8,
        ) => {}
        Err(other) => prop_assert!(false, "decode returned a framing error: {other:?}"),
    }
    Ok(())
}

/// A valid header (magic, version, a kind near the real ones) with random bytes after it, so
/// the fuzzing reaches the field parsers; or bytes that are random from the first.
fn body() -> impl Strategy<Value = Vec<u8>> {
    let tail = prop::collection::vec(any::<u8>(), 0..96);
    prop_oneof![
        1 => tail.clone(),
        3 => (0u8..6, tail).prop_map(|(kind, tail)| {
            let mut bytes = b"SBUF".to_vec();
            bytes.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
            bytes.push(kind);
            bytes.extend(tail);
            bytes
        }),
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Set { at: usize, byte: u8 },
    Insert { at: usize, byte: u8 },
    Remove { at: usize },
    Truncate { keep: usize },
    Append { bytes: Vec<u8> },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        3 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        3 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Set { at, byte }),
        1 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        1 => any::<usize>().prop_map(|at| Mutation::Remove { at }),
        1 => any::<usize>().prop_map(|keep| Mutation::Truncate { keep }),
        1 => prop::collection::vec(any::<u8>(), 1..8).prop_map(|bytes| Mutation::Append { bytes }),
    ]
}

fn mutate(bytes: &mut Vec<u8>, mutation: &Mutation) {
    let len = bytes.len();
    match *mutation {
        Mutation::Flip { at, bit } if len > 0 => bytes[at % len] ^= 1 << bit,
        Mutation::Set { at, byte } if len > 0 => bytes[at % len] = byte,
        Mutation::Insert { at, byte } => bytes.insert(at % (len + 1), byte),
        Mutation::Remove { at } if len > 0 => {
            bytes.remove(at % len);
        }
        Mutation::Truncate { keep } => bytes.truncate(keep % (len + 1)),
        Mutation::Append { bytes: ref tail } => bytes.extend_from_slice(tail),
        _ => {}
    }
}

#[test]
fn random_bodies_decode_to_typed_errors_or_to_their_own_encoding() {
    fuzz("random bodies", DECODE_CASES, body(), |bytes| {
        check_decode(&bytes)
    });
}

#[test]
fn mutated_messages_decode_to_typed_errors_or_to_their_own_encoding() {
    let strategy = (message(), prop::collection::vec(mutation(), 1..5));
    fuzz(
        "mutated messages",
        MUTATION_CASES,
        strategy,
        |(message, mutations)| {
            let mut bytes = message.encode();
            for m in &mutations {
                mutate(&mut bytes, m);
            }
            check_decode(&bytes)
        },
    );
}

#[test]
fn every_message_round_trips_and_fits_a_frame() {
    fuzz("round trips", ROUND_TRIP_CASES, message(), |message| {
        let expected = as_received(&message);
        let body = message.encode();
        prop_assert!(body.len() <= MAX_MESSAGE, "{} bytes", body.len());
        prop_assert_eq!(Message::decode(&body), Ok(expected.clone()));
        prop_assert_eq!(
            &expected.encode(),
            &body,
            "clipping is all encoding changes"
        );
        let frame = message.frame();
        prop_assert_eq!(&frame[4..], &body[..]);
        prop_assert_eq!(
            u32::from_le_bytes(frame[..4].try_into().unwrap()) as usize,
            body.len()
        );
        Ok(())
    });
}

/// One frame of a fuzzed stream.
#[derive(Clone, Debug)]
enum Frame {
    /// A real message, with this many descriptors attached.
    Message(Message, usize),
    /// A length prefix and random bytes.
    Garbage(Vec<u8>),
    /// A length prefix over [`MAX_MESSAGE`]; the stream cannot be read past it.
    Oversized(u32),
    /// The first `keep` bytes of a frame, then the sender closes.
    Cut(Message, usize),
}

fn frame() -> impl Strategy<Value = Frame> {
    let short = prop_oneof![
        (any::<u64>(), ".{0,12}", any::<[u8; 16]>()).prop_map(|(n, group, device_uuid)| {
            Message::Offer(Offer {
                layout_fingerprint: n,
                group,
                bytes: n >> 3,
                granularity: 2 << 20,
                device_uuid,
                dataset: n ^ 7,
            })
        }),
        any::<u64>().prop_map(|dataset| Message::Ack { dataset }),
        ".{0,16}".prop_map(|reason| Message::Reject { reason }),
    ];
    prop_oneof![
        6 => (short.clone(), prop_oneof![4 => Just(0usize), 2 => Just(1usize), 1 => 2usize..8])
            .prop_map(|(m, fds)| Frame::Message(m, fds)),
        3 => body().prop_map(Frame::Garbage),
        1 => ((MAX_MESSAGE as u32 + 1)..u32::MAX).prop_map(Frame::Oversized),
        1 => (short, any::<usize>()).prop_map(|(m, keep)| Frame::Cut(m, keep)),
    ]
}

/// A pipe whose read end travels over the socket: once every copy of it is closed, writing to
/// the write end fails with EPIPE, which is how the test sees that no descriptor leaked.
fn pipe() -> (OwnedFd, PipeWriter) {
    let (read, write) = std::io::pipe().expect("pipe");
    (read.into(), write)
}

fn all_readers_closed(mut write: &PipeWriter) -> bool {
    // Closing is synchronous on Linux; the short retry only absorbs scheduling noise. Rust
    // programs ignore SIGPIPE, so a write with no reader left is an EPIPE error.
    for _ in 0..100 {
        match std::io::Write::write(&mut write, b"x") {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return true,
            _ => std::thread::sleep(std::time::Duration::from_millis(1)),
        }
    }
    false
}

/// Sends `frame`; returns what `receive_message` must give for it, and whether the stream can
/// be read past it.
fn send_frame(
    socket: &UnixStream,
    frame: &Frame,
    writers: &mut Vec<PipeWriter>,
) -> (Result<(Message, usize), Error>, bool) {
    match frame {
        Frame::Message(message, fds) => {
            let mut readers = Vec::new();
            for _ in 0..*fds {
                let (read, write) = pipe();
                readers.push(read);
                writers.push(write);
            }
            let raw: Vec<i32> = readers.iter().map(|fd| fd.as_raw_fd()).collect();
            let bytes = message.frame();
            let control = [ControlMessage::ScmRights(&raw)];
            let cmsgs: &[ControlMessage] = if raw.is_empty() { &[] } else { &control };
            let iov = [std::io::IoSlice::new(&bytes)];
            let sent = sendmsg::<()>(socket.as_raw_fd(), &iov, cmsgs, MsgFlags::empty(), None)
                .expect("sendmsg");
            assert_eq!(sent, bytes.len(), "short send of a small frame");
            // Our copies close here; the ones in flight belong to the receiver now. However
            // many came, the receiver owns them all (checking the count is the caller's job:
            // `receive_dataset` wants exactly one).
            drop(readers);
            (Ok((message.clone(), *fds)), true)
        }
        Frame::Garbage(body) => {
            let mut bytes = (body.len() as u32).to_le_bytes().to_vec();
            bytes.extend_from_slice(body);
            std::io::Write::write_all(&mut &*socket, &bytes).expect("write");
            let expected = Message::decode(body).map(|m| (m, 0)).map_err(Error::from);
            (expected, true)
        }
        Frame::Oversized(len) => {
            std::io::Write::write_all(&mut &*socket, &len.to_le_bytes()).expect("write");
            (
                Err(Error::Share(ShareError::Protocol(ProtocolError::TooLarge(
                    *len as usize,
                )))),
                false,
            )
        }
        Frame::Cut(message, keep) => {
            let bytes = message.frame();
            let keep = keep % bytes.len();
            std::io::Write::write_all(&mut &*socket, &bytes[..keep]).expect("write");
            // Only a close before a frame's first byte is clean; inside one it is truncation.
            let expected = if keep == 0 {
                ProtocolError::Closed
            } else if keep < 4 {
                ProtocolError::Truncated {
                    needed: 4,
                    got: keep,
                }
            } else {
                ProtocolError::Truncated {
                    needed: bytes.len() - 4,
                    got: keep - 4,
                }
            };
            (Err(Error::Share(ShareError::Protocol(expected))), false)
        }
    }
}

fn same(
    got: &Result<(Message, Vec<OwnedFd>), Error>,
    want: &Result<(Message, usize), Error>,
) -> bool {
    match (got, want) {
        (Ok((m, fds)), Ok((wm, wfds))) => m == wm && fds.len() == *wfds,
        (
            Err(Error::Share(ShareError::Protocol(e))),
            Err(Error::Share(ShareError::Protocol(we))),
        ) => e == we,
        _ => false,
    }
}

#[test]
fn random_frame_streams_are_read_frame_by_frame_and_leak_no_descriptor() {
    let strategy = prop::collection::vec(frame(), 1..8);
    fuzz("frame streams", STREAM_CASES, strategy, |frames| {
        let (sender, receiver) = UnixStream::pair().expect("socket pair");
        receiver
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        let mut writers = Vec::new();
        let mut expected = Vec::new();
        let mut in_sync = true;
        for frame in &frames {
            let (outcome, readable) = send_frame(&sender, frame, &mut writers);
            expected.push(outcome);
            if !readable {
                in_sync = false;
                break;
            }
        }
        drop(sender);
        if in_sync {
            // Every frame was read whole: what follows is a clean close.
            expected.push(Err(Error::Share(ShareError::Protocol(
                ProtocolError::Closed,
            ))));
        }
        for (index, want) in expected.iter().enumerate() {
            let got = receive_message(&receiver);
            prop_assert!(
                same(&got, want),
                "frame {}: got {:?}, expected {:?}",
                index,
                got.as_ref().map(|(m, f)| (m, f.len())),
                want
            );
        }
        drop(receiver);
        for write in &writers {
            prop_assert!(
                all_readers_closed(write),
                "a received descriptor was not closed"
            );
        }
        Ok(())
    });
}

#[test]
fn long_and_multibyte_strings_arrive_clipped_on_a_character_boundary() {
    // Before the fix, a 65,535-byte cut could split a character (the peer saw BadUtf8), and a
    // Reject with a long reason made a frame the peer refused as TooLarge.
    let (a, b) = UnixStream::pair().unwrap();
    for c in ['x', 'é', '€', '𝄞'] {
        let reason: String = std::iter::repeat_n(c, 70_000).collect();
        send_message(
            &a,
            &Message::Reject {
                reason: reason.clone(),
            },
            None,
        )
        .unwrap();
        let (got, _) = receive_message(&b).unwrap();
        let Message::Reject { reason: got } = got else {
            panic!("not a reject")
        };
        assert!(reason.starts_with(&got));
        assert!(
            got.len() <= MAX_STRING && got.len() > MAX_STRING - 4,
            "{c:?}: {}",
            got.len()
        );
    }
}

#[test]
fn trailing_bytes_are_refused() {
    let mut bytes = Message::Ack { dataset: 3 }.encode();
    bytes.push(0);
    assert_eq!(
        Message::decode(&bytes),
        Err(ProtocolError::TrailingBytes { extra: 1 })
    );
}
