//! An incremental Server-Sent Events parser: bytes in (split anywhere), events out.
//!
//! Follows the WHATWG event-stream rules that matter here: lines end in LF, CRLF or CR (a CRLF
//! split across two chunks is one line end); `field: value` with one optional space after the
//! colon; several `data:` lines join with `\n`; `:` starts a comment; a blank line dispatches the
//! event, and an event without data is not dispatched. Bytes are buffered until a whole line is
//! there, so a multi-byte UTF-8 character split across chunks decodes correctly. At the end of
//! the stream, data whose blank line never came is still dispatched; an unterminated last line is
//! dropped (it may be cut mid-JSON).

/// One dispatched event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SseEvent {
    /// The `event:` field, if any.
    pub event: Option<String>,
    pub data: String,
}

/// A line longer than this is refused (a server that never ends a line would otherwise grow the
/// buffer without bound).
pub(crate) const MAX_LINE: usize = 16 * 1024 * 1024;

/// The line in progress was longer than [`MAX_LINE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LineTooLong;

#[derive(Debug, Default)]
pub(crate) struct SseParser {
    line: Vec<u8>,
    /// The previous chunk ended in CR: an LF at the start of the next one belongs to it.
    after_cr: bool,
    event: Option<String>,
    data: String,
    has_data: bool,
}

impl SseParser {
    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the events they complete.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, LineTooLong> {
        let mut out = Vec::new();
        let mut rest = bytes;
        if self.after_cr && !rest.is_empty() {
            self.after_cr = false;
            if let Some(stripped) = rest.strip_prefix(b"\n") {
                rest = stripped;
            }
        }
        while let Some(pos) = rest.iter().position(|&b| b == b'\n' || b == b'\r') {
            self.line.extend_from_slice(&rest[..pos]);
            let was_cr = rest[pos] == b'\r';
            rest = &rest[pos + 1..];
            if was_cr {
                match rest.first() {
                    Some(b'\n') => rest = &rest[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
            let line = std::mem::take(&mut self.line);
            if let Some(event) = self.line_done(&line) {
                out.push(event);
            }
        }
        self.line.extend_from_slice(rest);
        if self.line.len() > MAX_LINE {
            return Err(LineTooLong);
        }
        Ok(out)
    }

    /// The end of the stream: dispatches data still pending (the unterminated line is dropped).
    pub fn finish(&mut self) -> Option<SseEvent> {
        self.line.clear();
        self.dispatch()
    }

    fn line_done(&mut self, line: &[u8]) -> Option<SseEvent> {
        if line.is_empty() {
            return self.dispatch();
        }
        let line = String::from_utf8_lossy(line);
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((field, value)) => (field, value.strip_prefix(' ').unwrap_or(value)),
            None => (line.as_ref(), ""),
        };
        match field {
            "data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(value);
                self.has_data = true;
            }
            "event" => self.event = Some(value.to_owned()),
            // `id` and `retry` matter only to reconnecting browsers.
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        let event = self.event.take();
        if !std::mem::take(&mut self.has_data) {
            return None;
        }
        Some(SseEvent {
            event,
            data: std::mem::take(&mut self.data),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_in_pieces(input: &[u8], size: usize) -> Vec<SseEvent> {
        let mut p = SseParser::new();
        let mut out = Vec::new();
        for chunk in input.chunks(size) {
            out.extend(p.push(chunk).expect("line length"));
        }
        out.extend(p.finish());
        out
    }

    fn ev(event: Option<&str>, data: &str) -> SseEvent {
        SseEvent {
            event: event.map(str::to_owned),
            data: data.to_owned(),
        }
    }

    #[test]
    fn events_survive_any_split() {
        let input = "event: message_start\r\ndata: {\"a\":\"h\u{e9}llo \u{1f600}\"}\r\n\r\n: a comment\n\ndata: one\ndata:two\n\nevent: ping\n\ndata: [DONE]\r\rdata: tail\n"
            .as_bytes();
        let expected = vec![
            ev(Some("message_start"), "{\"a\":\"h\u{e9}llo \u{1f600}\"}"),
            ev(None, "one\ntwo"),
            ev(None, "[DONE]"),
            ev(None, "tail"),
        ];
        for size in 1..=input.len() {
            assert_eq!(parse_in_pieces(input, size), expected, "chunk size {size}");
        }
    }

    #[test]
    fn a_crlf_split_between_chunks_is_one_line_end() {
        let mut p = SseParser::new();
        assert_eq!(p.push(b"data: a\r").expect("ok"), vec![]);
        assert_eq!(p.push(b"").expect("ok"), vec![]);
        assert_eq!(p.push(b"\n\r").expect("ok"), vec![ev(None, "a")]);
        assert_eq!(p.push(b"\ndata: b\n\n").expect("ok"), vec![ev(None, "b")]);
    }

    #[test]
    fn an_unterminated_last_line_is_dropped() {
        let mut p = SseParser::new();
        assert_eq!(p.push(b"data: {\"cut").expect("ok"), vec![]);
        assert_eq!(p.finish(), None);
    }

    #[test]
    fn endless_lines_are_refused() {
        let mut p = SseParser::new();
        let chunk = vec![b'x'; 1024 * 1024];
        let mut result = Ok(vec![]);
        for _ in 0..=(MAX_LINE / chunk.len()) {
            result = p.push(&chunk);
            if result.is_err() {
                break;
            }
        }
        assert_eq!(result, Err(LineTooLong));
    }
}
