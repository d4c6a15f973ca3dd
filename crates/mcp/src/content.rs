//! Turning a `tools/call` result into the one string the model is shown.
//!
//! Rules, applied to the result's JSON so that content types this crate does not know yet are
//! still shown rather than lost:
//! - `text` blocks: their text, as is;
//! - any other block (`image`, `audio`, `resource`, `resource_link`, future types): a one-line
//!   JSON description with its type, MIME type, size in bytes and URI where they exist, e.g.
//!   `{"type":"image","mimeType":"image/png","bytes":1234}` — never the payload itself;
//! - blocks are joined with `"\n"`, in order;
//! - when there is no text block and the result has `structuredContent`, its JSON comes first.

use serde_json::{Map, Value};

/// The text for the model. `content` is the result's `content` array and `structured` its
/// `structuredContent`, both as JSON.
pub(crate) fn render(content: &Value, structured: Option<&Value>) -> String {
    let blocks: &[Value] = match content {
        Value::Array(blocks) => blocks,
        Value::Null => &[],
        other => std::slice::from_ref(other),
    };
    let mut has_text = false;
    let mut parts = Vec::with_capacity(blocks.len() + 1);
    for block in blocks {
        match (
            block.get("type").and_then(Value::as_str),
            block.get("text").and_then(Value::as_str),
        ) {
            (Some("text"), Some(text)) => {
                has_text = true;
                parts.push(text.to_owned());
            }
            _ => parts.push(describe(block)),
        }
    }
    if !has_text && let Some(structured) = structured {
        parts.insert(0, structured.to_string());
    }
    parts.join("\n")
}

/// A short description of a non-text block.
fn describe(block: &Value) -> String {
    let mut out = Map::new();
    let kind = block
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("unknown");
    out.insert("type".into(), Value::from(kind));
    // An embedded resource keeps its fields one level down.
    let inner = block
        .get("resource")
        .filter(|r| r.is_object())
        .unwrap_or(block);
    if let Some(mime) = inner.get("mimeType").and_then(Value::as_str) {
        out.insert("mimeType".into(), Value::from(mime));
    }
    let bytes = if let Some(data) = inner
        .get("data")
        .or_else(|| inner.get("blob"))
        .and_then(Value::as_str)
    {
        Some(base64_decoded_len(data) as u64)
    } else if let Some(text) = inner.get("text").and_then(Value::as_str) {
        Some(text.len() as u64)
    } else {
        inner.get("size").and_then(Value::as_u64)
    };
    if let Some(bytes) = bytes {
        out.insert("bytes".into(), Value::from(bytes));
    }
    for key in ["uri", "name"] {
        if let Some(value) = inner.get(key).and_then(Value::as_str) {
            out.insert(key.into(), Value::from(value));
        }
    }
    Value::Object(out).to_string()
}

/// Size of the bytes that base64 `data` encodes (whitespace and padding ignored).
fn base64_decoded_len(data: &str) -> usize {
    let symbols = data
        .bytes()
        .filter(|b| !b.is_ascii_whitespace() && *b != b'=')
        .count();
    symbols * 3 / 4
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn texts_are_joined() {
        let content = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        assert_eq!(render(&content, None), "a\nb");
    }

    #[test]
    fn non_text_blocks_are_described_not_dropped() {
        let content = json!([
            {"type": "text", "text": "here:"},
            {"type": "image", "data": "AAAA", "mimeType": "image/png"},
            {"type": "audio", "data": "AAA=", "mimeType": "audio/wav"},
            {"type": "resource", "resource": {"uri": "file:///x", "mimeType": "text/plain", "text": "hello"}},
            {"type": "resource", "resource": {"uri": "file:///y", "blob": "AAAAAA=="}},
            {"type": "resource_link", "uri": "file:///z", "name": "z", "size": 7},
            {"type": "hologram"}
        ]);
        let lines: Vec<Value> = render(&content, None)
            .lines()
            .skip(1)
            .map(|l| serde_json::from_str(l).unwrap_or(Value::Null))
            .collect();
        assert_eq!(
            lines,
            vec![
                json!({"type": "image", "mimeType": "image/png", "bytes": 3}),
                json!({"type": "audio", "mimeType": "audio/wav", "bytes": 2}),
                json!({"type": "resource", "mimeType": "text/plain", "bytes": 5, "uri": "file:///x"}),
                json!({"type": "resource", "bytes": 4, "uri": "file:///y"}),
                json!({"type": "resource_link", "bytes": 7, "uri": "file:///z", "name": "z"}),
                json!({"type": "hologram"}),
            ]
        );
    }

    #[test]
    fn structured_content_when_no_text() {
        let structured = json!({"temperature": 21});
        assert_eq!(
            render(&json!([]), Some(&structured)),
            r#"{"temperature":21}"#
        );
        // With text, the text is what the server meant for the model.
        assert_eq!(
            render(&json!([{"type": "text", "text": "21C"}]), Some(&structured)),
            "21C"
        );
        assert_eq!(render(&Value::Null, None), "");
    }
}
