//! Fewer TLS records and `writev`s per gRPC response.
//!
//! h2 writes a response DATA frame of 256 bytes or more from the body's own
//! buffer instead of copying it, and then must flush before it can buffer
//! the next frame. A unary response (HEADERS, DATA, trailers) therefore
//! reached the socket as two flushes, each one TLS record and one `writev`
//! (the second holding only the trailers). `TlsConn` keeps the plaintext
//! written since the last flush, and a flush that ends on a DATA frame
//! without END_STREAM is held back: the trailers (or an END_STREAM DATA, or
//! RST_STREAM) of the same stream follow in the same poll of the connection,
//! and go out with it in one record and one `writev`. Every other flush is
//! passed on at once. A held flush also wakes the connection's task, whose
//! next poll (its read) releases the bytes, so nothing waits longer than
//! one turn of the scheduler, even when h2 has nothing more to write (a
//! stream blocked on flow control). That turn also lets responses finished
//! meanwhile by other streams join the same write. This module only reads
//! the frame headers of what h2 writes; it never changes a byte.

/// Held plaintext beyond which writes go to TLS without waiting for a flush
/// (one full TLS record).
pub const HOLD_MAX: usize = 16 * 1024;

const FRAME_HEADER: usize = 9;
const TYPE_DATA: u8 = 0;
const FLAG_END_STREAM: u8 = 1;

/// Follows the HTTP/2 frame boundaries in the server's outgoing byte stream
/// (which begins with a frame: the server sends no preface string).
#[derive(Debug, Default, Clone)]
pub struct FrameTracker {
    header: [u8; FRAME_HEADER],
    header_len: usize,
    payload_left: usize,
    /// The last complete frame is DATA without END_STREAM.
    open_data: bool,
}

impl FrameTracker {
    /// Accounts for `bytes` written after everything seen so far.
    pub fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.payload_left > 0 {
                let n = self.payload_left.min(bytes.len());
                self.payload_left -= n;
                bytes = &bytes[n..];
                continue;
            }
            let n = (FRAME_HEADER - self.header_len).min(bytes.len());
            self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
            self.header_len += n;
            bytes = &bytes[n..];
            if self.header_len == FRAME_HEADER {
                let h = &self.header;
                self.payload_left =
                    (usize::from(h[0]) << 16) | (usize::from(h[1]) << 8) | usize::from(h[2]);
                self.open_data = h[3] == TYPE_DATA && h[4] & FLAG_END_STREAM == 0;
                self.header_len = 0;
            }
        }
    }

    /// Whether a flush now may wait for the frames that follow: the bytes
    /// end exactly after a DATA frame that does not end its stream.
    pub fn may_hold(&self) -> bool {
        self.header_len == 0 && self.payload_left == 0 && self.open_data
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, len: usize) -> Vec<u8> {
        let mut f = vec![
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            kind,
            flags,
            0,
            0,
            0,
            1,
        ];
        f.resize(FRAME_HEADER + len, 0xAB);
        f
    }

    #[test]
    fn holds_only_after_a_whole_data_frame_without_end_stream() {
        let headers = frame(1, 4, 12);
        let data = frame(TYPE_DATA, 0, 2600);
        let data_end = frame(TYPE_DATA, FLAG_END_STREAM, 10);
        let trailers = frame(1, 4 | 1, 20);
        let settings = frame(4, 0, 18);
        let empty_data = frame(TYPE_DATA, 0, 0);
        let cases: Vec<(Vec<&[u8]>, bool)> = vec![
            (vec![&headers], false),
            (vec![&headers, &data], true),
            (vec![&headers, &data[..100]], false),
            (vec![&headers, &data[..5]], false),
            (vec![&headers, &data, &trailers], false),
            (vec![&headers, &data_end], false),
            (vec![&headers, &data, &trailers, &headers, &data], true),
            (vec![&settings], false),
            (vec![&empty_data], true),
        ];
        for (i, (writes, want)) in cases.into_iter().enumerate() {
            let mut t = FrameTracker::default();
            for w in writes {
                t.feed(w);
            }
            assert_eq!(t.may_hold(), want, "case {i}");
        }
    }

    #[test]
    fn boundaries_survive_any_split_of_the_writes() {
        let mut stream = frame(4, 0, 6);
        stream.extend(frame(1, 4, 30));
        stream.extend(frame(TYPE_DATA, 0, 2700));
        for cut in [1, 3, 8, 9, 10, 17, 100, 4096] {
            let mut t = FrameTracker::default();
            for chunk in stream.chunks(cut) {
                t.feed(chunk);
            }
            assert!(t.may_hold(), "cut {cut}");
            t.feed(&frame(1, 5, 3)[..4]);
            assert!(!t.may_hold(), "cut {cut}");
        }
    }
}
