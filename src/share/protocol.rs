//! The wire format of dataset sharing: framed, versioned messages. Pure encoding and decoding,
//! no sockets and no CUDA, so every byte rule is tested on the CPU.
//!
//! A frame is a 4-byte little-endian length, then the message: magic `SBUF`, version `u16`,
//! kind `u8`, then the kind's fields (integers little-endian, strings as `u16` length + UTF-8,
//! at most [`MAX_STRING`] bytes). Nothing follows the last field.

use crate::error::ProtocolError;

const MAGIC: &[u8; 4] = b"SBUF";
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u16 = 1;
/// Messages larger than this are refused before anything is allocated for them.
pub const MAX_MESSAGE: usize = 64 << 10;
/// Longest string field sent, in bytes: a longer one is cut at the last character boundary at
/// or below it, so every message this build encodes fits in [`MAX_MESSAGE`] and decodes.
pub const MAX_STRING: usize = MAX_MESSAGE - 64;

/// Describes a dataset sent to another process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offer {
    /// [`Layout::fingerprint`](crate::Layout::fingerprint) of the producer's layout; the
    /// consumer's must be equal.
    pub layout_fingerprint: u64,
    /// The slot group the dataset backs.
    pub group: String,
    /// Bytes of physical memory behind the descriptor.
    pub bytes: u64,
    /// The producer's allocation granularity for shareable memory, in bytes (informative: the
    /// consumer checks layout, group, size and device).
    pub granularity: u64,
    /// `cuDeviceGetUuid` of the producer's device.
    pub device_uuid: [u8; 16],
    /// The producer's dataset id (echoed in the Ack).
    pub dataset: u64,
}

/// One message of the protocol.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// Producer → consumer: a dataset, its file descriptor riding along (SCM_RIGHTS).
    Offer(Offer),
    /// Consumer → producer: the dataset was imported and checked.
    Ack {
        /// The producer's dataset id, from the offer.
        dataset: u64,
    },
    /// Consumer → producer: the offer was refused (the consumer gets the matching typed error).
    Reject {
        /// Why, in words (the consumer's error message).
        reason: String,
    },
}

pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        Self { bytes, at: 0 }
    }
    /// Bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }
    pub(crate) fn take(&mut self, n: usize) -> Result<&'a [u8], ProtocolError> {
        let end = self.at + n;
        if end > self.bytes.len() {
            return Err(ProtocolError::Truncated {
                needed: end,
                got: self.bytes.len(),
            });
        }
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }
    /// Reads a body's magic and version: [`ProtocolError::BadMagic`] or
    /// [`ProtocolError::Version`] unless they are `magic` and `version`.
    pub(crate) fn header(&mut self, magic: &[u8; 4], version: u16) -> Result<(), ProtocolError> {
        if self.take(4)? != magic {
            return Err(ProtocolError::BadMagic);
        }
        let got = self.u16()?;
        if got != version {
            return Err(ProtocolError::Version {
                got,
                supported: version,
            });
        }
        Ok(())
    }

    pub(crate) fn u8(&mut self) -> Result<u8, ProtocolError> {
        Ok(self.take(1)?[0])
    }
    pub(crate) fn u16(&mut self) -> Result<u16, ProtocolError> {
        Ok(u16::from_le_bytes(
            self.take(2)?.try_into().expect("2 bytes"),
        ))
    }
    pub(crate) fn u64(&mut self) -> Result<u64, ProtocolError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    pub(crate) fn string(&mut self) -> Result<String, ProtocolError> {
        let len = usize::from(self.u16()?);
        if len > MAX_STRING {
            return Err(ProtocolError::StringTooLong { bytes: len });
        }
        String::from_utf8(self.take(len)?.to_vec()).map_err(|_| ProtocolError::BadUtf8)
    }
}

/// `s` cut to at most [`MAX_STRING`] bytes, on a character boundary (never inside one, which the
/// peer would refuse as [`ProtocolError::BadUtf8`]).
pub(crate) fn clip(s: &str) -> &str {
    let mut end = s.len().min(MAX_STRING);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// A frame: the body's length (`u32`, little-endian), then the body. Both protocols frame their
/// messages so ([`Message::frame`], [`super::publish::PublishMessage::frame`]).
pub(crate) fn frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(body);
    out
}

pub(crate) fn put_string(out: &mut Vec<u8>, s: &str) {
    let bytes = clip(s).as_bytes();
    out.extend_from_slice(&(bytes.len() as u16).to_le_bytes());
    out.extend_from_slice(bytes);
}

impl Message {
    /// The message body (without the length prefix).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = MAGIC.to_vec();
        out.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        match self {
            Message::Offer(o) => {
                out.push(1);
                out.extend_from_slice(&o.layout_fingerprint.to_le_bytes());
                put_string(&mut out, &o.group);
                out.extend_from_slice(&o.bytes.to_le_bytes());
                out.extend_from_slice(&o.granularity.to_le_bytes());
                out.extend_from_slice(&o.device_uuid);
                out.extend_from_slice(&o.dataset.to_le_bytes());
            }
            Message::Ack { dataset } => {
                out.push(2);
                out.extend_from_slice(&dataset.to_le_bytes());
            }
            Message::Reject { reason } => {
                out.push(3);
                put_string(&mut out, reason);
            }
        }
        out
    }

    /// Parses a message body. Only the exact bytes [`Message::encode`] writes are accepted:
    /// anything after the message's last field is [`ProtocolError::TrailingBytes`].
    pub fn decode(bytes: &[u8]) -> Result<Message, ProtocolError> {
        let mut r = Reader::new(bytes);
        r.header(MAGIC, PROTOCOL_VERSION)?;
        let message = match r.u8()? {
            1 => Message::Offer(Offer {
                layout_fingerprint: r.u64()?,
                group: r.string()?,
                bytes: r.u64()?,
                granularity: r.u64()?,
                device_uuid: r.take(16)?.try_into().expect("16 bytes"),
                dataset: r.u64()?,
            }),
            2 => Message::Ack { dataset: r.u64()? },
            3 => Message::Reject {
                reason: r.string()?,
            },
            other => return Err(ProtocolError::UnknownKind(other)),
        };
        match bytes.len() - r.at {
            0 => Ok(message),
            extra => Err(ProtocolError::TrailingBytes { extra }),
        }
    }

    /// Length prefix (`u32`, little-endian) + body.
    pub fn frame(&self) -> Vec<u8> {
        frame(&self.encode())
    }
}
