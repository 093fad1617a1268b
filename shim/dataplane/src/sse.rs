//! A stream's events as shim/wire.py's SSESplitter and StreamMeter see them: split into (event, data), with
//! what decides when the harness may have them (the first content event), whether the stream is done or broke
//! with an error event, an output estimate from delta sizes, and the usage the events carried, merged as
//! StreamMeter merges it (a later event's non-null values over an earlier one's).
use memchr::memmem;

pub const ANTHROPIC: u8 = 0;
pub const OPENAI: u8 = 1;

const DELTA_OVERHEAD: usize = 70;

#[derive(Default)]
pub struct Meter {
    pub kind: u8,
    pub meaningful: bool,
    pub done: bool,
    pub error: Option<Vec<u8>>, // the error event's data
    pub error_before_content: bool,
    pub delta_tokens: u64,
    pub usage: serde_json::Map<String, serde_json::Value>,
    pub saw_usage: bool,
    envelope: usize,
    pending: Vec<u8>, // bytes not yet split into whole events
}

fn trim_start(b: &[u8]) -> &[u8] {
    let n = b.iter().take_while(|&&c| c == b' ').count();
    &b[n..]
}

fn trim(b: &[u8]) -> &[u8] {
    let start = b.iter().take_while(|c| c.is_ascii_whitespace()).count();
    let end = b.len() - b[start..].iter().rev().take_while(|c| c.is_ascii_whitespace()).count();
    &b[start..end]
}

/// A block's event name and data (data lines joined with \n), as SSESplitter.
fn parse_block(block: &[u8]) -> Option<(Option<Vec<u8>>, Vec<u8>)> {
    let mut event = None;
    let mut data: Vec<&[u8]> = Vec::new();
    for line in block.split(|&b| b == b'\n') {
        if let Some(rest) = line.strip_prefix(b"data:") {
            data.push(trim_start(rest));
        } else if let Some(rest) = line.strip_prefix(b"event:") {
            event = Some(trim(rest).to_vec());
        }
    }
    if data.is_empty() {
        return None;
    }
    Some((event, data.join(&b'\n')))
}

fn has_usage_object(data: &[u8]) -> bool {
    // rb'"usage"\s*:\s*\{'
    let mut from = 0;
    while let Some(i) = memmem::find(&data[from..], b"\"usage\"") {
        let mut j = from + i + 7;
        while j < data.len() && data[j].is_ascii_whitespace() {
            j += 1;
        }
        if data.get(j) == Some(&b':') {
            j += 1;
            while j < data.len() && data[j].is_ascii_whitespace() {
                j += 1;
            }
            if data.get(j) == Some(&b'{') {
                return true;
            }
        }
        from += i + 7;
    }
    false
}

impl Meter {
    pub fn new(kind: u8) -> Meter {
        Meter { kind, ..Default::default() }
    }

    /// Takes a piece of the stream as it arrived.
    pub fn feed(&mut self, piece: &[u8]) {
        self.pending.extend_from_slice(piece);
        if memchr::memchr(b'\r', &self.pending).is_some() {
            let text = std::mem::take(&mut self.pending);
            let mut out = Vec::with_capacity(text.len());
            let mut i = 0;
            while i < text.len() {
                if text[i] == b'\r' && text.get(i + 1) == Some(&b'\n') {
                    i += 1;
                    continue;
                }
                out.push(text[i]);
                i += 1;
            }
            self.pending = out;
        }
        let mut start = 0;
        while let Some(i) = memmem::find(&self.pending[start..], b"\n\n") {
            let block = self.pending[start..start + i].to_vec();
            start += i + 2;
            if let Some((event, data)) = parse_block(&block) {
                self.on_event(event, data);
            }
        }
        self.pending.drain(..start);
    }

    fn on_event(&mut self, event: Option<Vec<u8>>, data: Vec<u8>) {
        if self.kind == ANTHROPIC {
            self.anthropic(event, data)
        } else {
            self.openai(data)
        }
    }

    fn anthropic(&mut self, event: Option<Vec<u8>>, data: Vec<u8>) {
        let name = match &event {
            Some(e) => e.clone(),
            None => {
                let i = memmem::find(&data, b"\"type\"");
                let mut name = Vec::new();
                if let Some(i) = i {
                    let window = &data[i..(i + 40).min(data.len())];
                    let parts: Vec<&[u8]> = window.split(|&b| b == b'"').collect();
                    if parts.len() >= 5 {
                        name = parts[3].to_vec();
                    }
                }
                name
            }
        };
        match name.as_slice() {
            b"content_block_delta" => {
                self.meaningful = true;
                self.delta_tokens += (data.len().saturating_sub(DELTA_OVERHEAD) / 4).max(1) as u64;
            }
            b"message_start" => {
                if let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&data) {
                    self.merge(doc.get("message").and_then(|m| m.get("usage")));
                }
            }
            b"message_delta" => {
                self.meaningful = true;
                if let Ok(doc) = serde_json::from_slice::<serde_json::Value>(&data) {
                    self.merge(doc.get("usage"));
                }
            }
            b"message_stop" => {
                self.meaningful = true;
                self.done = true;
            }
            b"error" => self.error(&data),
            _ => {}
        }
    }

    fn openai(&mut self, data: Vec<u8>) {
        if data == b"[DONE]" {
            self.meaningful = true;
            self.done = true;
            return;
        }
        let has_usage = has_usage_object(&data);
        if has_usage || memmem::find(&data, b"\"error\"").is_some() || !self.meaningful {
            let doc: serde_json::Value = match serde_json::from_slice(&data) {
                Ok(v) => v,
                Err(_) => return,
            };
            let obj = match doc.as_object() {
                Some(o) => o,
                None => return,
            };
            if obj.get("error").map_or(false, |e| e.is_object()) {
                self.error(&data);
                return;
            }
            self.merge(obj.get("usage"));
            let choices = obj.get("choices").and_then(|c| c.as_array());
            if self.envelope == 0 && choices.map_or(false, |c| !c.is_empty()) {
                self.envelope = data.len();
            }
            if !self.meaningful {
                for choice in choices.into_iter().flatten() {
                    let delta = choice.get("delta");
                    let has = |k: &str| delta.and_then(|d| d.get(k)).map_or(false, truthy);
                    if has("content")
                        || has("tool_calls")
                        || has("refusal")
                        || has("reasoning_content")
                        || choice.get("finish_reason").map_or(false, truthy)
                    {
                        self.meaningful = true;
                    }
                }
            }
        }
        if memmem::find(&data, b"\"delta\"").is_some() && !has_usage {
            let envelope = if self.envelope > 0 { self.envelope } else { 2 * DELTA_OVERHEAD };
            self.delta_tokens += (data.len().saturating_sub(envelope) / 4 + 1).max(1) as u64;
        }
    }

    fn merge(&mut self, usage: Option<&serde_json::Value>) {
        if let Some(serde_json::Value::Object(u)) = usage {
            self.saw_usage = true;
            for (k, v) in u {
                if !v.is_null() {
                    self.usage.insert(k.clone(), v.clone());
                }
            }
        }
    }

    fn error(&mut self, data: &[u8]) {
        self.error = Some(data.to_vec());
        if !self.meaningful {
            self.error_before_content = true;
        }
    }

    /// wire.retryable_stream_error on the error event's text.
    pub fn retryable_error(&self) -> bool {
        let e = match &self.error {
            Some(e) => e,
            None => return false,
        };
        let low = e.to_ascii_lowercase();
        let has = |m: &[u8]| memmem::find(&low, m).is_some();
        if has(b"enforced_spend_limit_reached") || has(b"insufficient_quota") || has(b"billing_hard_limit") {
            return false;
        }
        has(b"overloaded") || has(b"rate_limit") || has(b"api_error") || has(b"server_error")
    }
}

/// Python's truthiness of a JSON value.
fn truthy(v: &serde_json::Value) -> bool {
    match v {
        serde_json::Value::Null => false,
        serde_json::Value::Bool(b) => *b,
        serde_json::Value::Number(n) => n.as_f64().map_or(true, |f| f != 0.0),
        serde_json::Value::String(s) => !s.is_empty(),
        serde_json::Value::Array(a) => !a.is_empty(),
        serde_json::Value::Object(o) => !o.is_empty(),
    }
}

/// An in-stream error event in the route's format (shim/server.py Shim._sse_error).
pub fn error_event(kind: u8, message: &str) -> Vec<u8> {
    let msg = serde_json::Value::String(message.to_string()).to_string();
    if kind == ANTHROPIC {
        format!("event: error\ndata: {{\"type\": \"error\", \"error\": {{\"type\": \"api_error\", \"message\": {msg}}}}}\n\n")
            .into_bytes()
    } else {
        format!("data: {{\"error\": {{\"type\": \"server_error\", \"message\": {msg}}}}}\n\n").into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anthropic_stream() {
        let mut m = Meter::new(ANTHROPIC);
        m.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5}}}\n\n");
        m.feed(b"event: ping\r\ndata: {}\r\n\r\nevent: content_block_delta\ndata: {\"type\":\"content_");
        assert!(!m.meaningful);
        m.feed(b"block_delta\"}\n\n");
        assert!(m.meaningful && !m.done);
        assert_eq!(m.delta_tokens, 1);
        m.feed(b"data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":3}}\n\nevent: message_stop\ndata: {}\n\n");
        assert!(m.done && m.saw_usage);
        assert_eq!(serde_json::Value::Object(m.usage.clone()), serde_json::json!({"input_tokens": 5, "output_tokens": 3}));
    }

    #[test]
    fn openai_stream() {
        let mut m = Meter::new(OPENAI);
        m.feed(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"usage\":null}\n\n");
        assert!(!m.meaningful);
        m.feed(b"data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n");
        assert!(m.meaningful);
        m.feed(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3}}\n\ndata: [DONE]\n\n");
        assert!(m.done);
        assert_eq!(m.usage.get("prompt_tokens"), Some(&serde_json::json!(3)));
        let mut e = Meter::new(OPENAI);
        e.feed(b"data: {\"error\":{\"type\":\"server_error\",\"message\":\"Overloaded\"}}\n\n");
        assert!(e.error_before_content && e.retryable_error());
    }
}
