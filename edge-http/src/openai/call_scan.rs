//! Finding tool calls in the model's output as it streams
//! ([`CallScan`]): text that is surely content is released at once; text
//! that may still become a call (a partial `<tool_call>`, whitespace that
//! would separate calls) is held back until it is decided, so a call's
//! markup never leaks as content. A call's JSON that does not parse, or
//! names no function, is given back as content, and the scan stops looking
//! for calls (docs/api.md "Tools").
//!
//! An answer that is a bare JSON object (`{"name": …, "arguments": …}`
//! with nothing around it) is a call too when it names a declared tool:
//! Llama 3.x's format, and what Qwen2.5-Coder writes in place of its
//! `<tool_call>` block when the call is not forced. Such an answer is held
//! to its end.

use serde_json::Value;

use super::tools::CallFormat;

/// A piece of the output, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Content text.
    Text(String),
    /// A complete call: the function's name and its arguments as compact
    /// JSON text (OpenAI's `function.arguments`).
    Call { name: String, arguments: String },
}

/// The scanner's state over one generation.
pub struct CallScan {
    format: CallFormat,
    /// The declared tools' names (a bare JSON call must name one).
    declared: Vec<String>,
    /// The answer is a bare JSON object (held to the end).
    bare: bool,
    /// Text received and not yet decided.
    held: String,
    /// Inside a call (its opening seen; `held` is the call's body so far).
    in_call: bool,
    /// Calls found.
    calls: usize,
    /// A call was malformed: everything from there on is content.
    plain: bool,
    /// Content was released since the last call (whitespace that follows
    /// a call is dropped only until then).
    text_since_call: bool,
}

impl CallScan {
    pub fn new(format: CallFormat, declared: Vec<String>) -> Self {
        Self {
            format,
            declared,
            bare: false,
            held: String::new(),
            in_call: false,
            calls: 0,
            plain: false,
            text_since_call: false,
        }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// Adds generated text (or, first, a forced call's prefix); returns
    /// what is decided.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.held.push_str(text);
        self.run(false)
    }

    /// The end of the generation: whatever is held is decided. A call whose
    /// closing is missing counts when its JSON is complete and well formed
    /// (the model stopped right after it).
    pub fn finish(&mut self) -> Vec<Piece> {
        self.run(true)
    }

    fn run(&mut self, at_end: bool) -> Vec<Piece> {
        let mut out = Vec::new();
        while self.step(at_end, &mut out) {}
        out
    }

    /// One decision on `held`; false when nothing more can be decided.
    fn step(&mut self, at_end: bool, out: &mut Vec<Piece>) -> bool {
        if self.calls > 0 && !self.text_since_call && !self.in_call {
            let blank = self.held.len() - self.held.trim_start().len();
            self.held.drain(..blank);
        }
        if self.held.is_empty() {
            return false;
        }
        if self.plain {
            let all = std::mem::take(&mut self.held);
            self.release(all, out);
            return false;
        }
        let tags = self.format.tags().filter(|_| !self.bare);
        let Some((open, close)) = tags else {
            return self.step_bare_json(at_end, out);
        };
        if self.in_call {
            return self.step_in_call(close, at_end, out);
        }
        if self.calls == 0 && !self.text_since_call && self.held.trim_start().starts_with('{') {
            self.bare = true;
            return true;
        }
        if let Some(pos) = self.held.find(open) {
            let before: String = self.held.drain(..pos).collect();
            self.held.drain(..open.len());
            self.in_call = true;
            // Whitespace before a call is not content.
            if !before.trim().is_empty() {
                self.release(before, out);
            }
            return true;
        }
        if at_end {
            let all = std::mem::take(&mut self.held);
            self.release(all, out);
            return false;
        }
        // Hold a tail that may start the opening, and trailing whitespace
        // (it may only separate the text from a call).
        let undecided = held_tail(&self.held, open);
        let ready = self.held[..self.held.len() - undecided].trim_end().len();
        if ready > 0 {
            let text: String = self.held.drain(..ready).collect();
            self.release(text, out);
        }
        false
    }

    /// Inside a call: its closing decides it; at the end, a complete JSON
    /// body does too.
    fn step_in_call(&mut self, close: &str, at_end: bool, out: &mut Vec<Piece>) -> bool {
        let (body_end, closed) = match self.held.find(close) {
            Some(pos) => (pos, true),
            None if at_end => (self.held.len(), false),
            None => return false,
        };
        let body: String = self.held.drain(..body_end).collect();
        if closed {
            self.held.drain(..close.len());
        }
        self.in_call = false;
        match parse_call(&body, None) {
            Some(call) => self.accept(call, out),
            None => {
                // Malformed: the call's own text becomes content.
                self.plain = true;
                let open = self.format.tags().map_or("", |(open, _)| open);
                let mut text = format!("{open}{body}");
                if closed {
                    text.push_str(close);
                }
                self.release(text, out);
            }
        }
        true
    }

    /// A bare JSON call: an answer that starts with `{` is held to the end
    /// and is a call if it parses as one naming a declared tool; any other
    /// answer is content as it comes.
    fn step_bare_json(&mut self, at_end: bool, out: &mut Vec<Piece>) -> bool {
        if !self.in_call {
            match self.held.trim_start().chars().next() {
                Some('{') => self.in_call = true,
                Some(_) => self.plain = true,
                None if at_end => self.plain = true,
                None => return false,
            }
            return true;
        }
        if !at_end {
            return false;
        }
        let body = std::mem::take(&mut self.held);
        self.in_call = false;
        match parse_call(&body, Some(&self.declared)) {
            Some(call) => self.accept(call, out),
            None => {
                self.plain = true;
                self.release(body, out);
            }
        }
        false
    }

    /// A parsed call: counted and sent.
    fn accept(&mut self, call: Piece, out: &mut Vec<Piece>) {
        self.calls += 1;
        self.text_since_call = false;
        out.push(call);
    }

    fn release(&mut self, text: String, out: &mut Vec<Piece>) {
        if !text.is_empty() {
            self.text_since_call = true;
            out.push(Piece::Text(text));
        }
    }
}

/// How many bytes at the end of `text` are a proper prefix of `open`.
fn held_tail(text: &str, open: &str) -> usize {
    (1..open.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && text.ends_with(&open[..n]))
        .unwrap_or(0)
}

/// `{"name": "…", "arguments": {…}}` (`parameters` is taken for
/// `arguments`; arguments given as a JSON text are parsed; absent: `{}`);
/// with `declared`, the name must be one of them.
fn parse_call(body: &str, declared: Option<&[String]>) -> Option<Piece> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?;
    if name.is_empty() || declared.is_some_and(|d| !d.iter().any(|n| n == name)) {
        return None;
    }
    let arguments = match o.get("arguments").or_else(|| o.get("parameters")) {
        None | Some(Value::Null) => Value::Object(serde_json::Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s).ok()?,
        Some(a) => a.clone(),
    };
    Some(Piece::Call {
        name: name.to_string(),
        arguments: arguments.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(prefix: &str, pieces: &[&str]) -> Vec<Piece> {
        let mut s = CallScan::new(CallFormat::Hermes, vec!["f".into(), "get_weather".into()]);
        let mut out = s.push(prefix);
        for p in pieces {
            out.extend(s.push(p));
        }
        out.extend(s.finish());
        // Consecutive texts as one (how they are cut does not matter).
        let mut merged: Vec<Piece> = Vec::new();
        for p in out {
            match (merged.last_mut(), p) {
                (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                (_, p) => merged.push(p),
            }
        }
        merged
    }

    fn text(t: &str) -> Piece {
        Piece::Text(t.into())
    }

    fn call(name: &str, args: &str) -> Piece {
        Piece::Call {
            name: name.into(),
            arguments: args.into(),
        }
    }

    #[test]
    fn calls_are_found_across_pieces_and_never_leak() {
        let out = scan(
            "",
            &[
                "Let me check.\n<tool",
                "_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": ",
                "\"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_",
                "call>",
            ],
        );
        assert_eq!(
            out,
            [
                text("Let me check."),
                call("get_weather", r#"{"city":"Oslo"}"#),
                call("f", "{}"),
            ]
        );
        // Plain text streams as it comes (a tail that might open a call is
        // held, then released).
        let mut s = CallScan::new(CallFormat::Hermes, vec!["f".into(), "get_weather".into()]);
        assert_eq!(s.push("a <"), [text("a")]);
        assert_eq!(s.push("b"), [text(" <b")]);
        assert_eq!(s.finish(), []);
    }

    #[test]
    fn forced_prefixes_and_unclosed_calls() {
        // A named call forced by the prompt: the model continues the JSON.
        let out = scan(
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": ",
            &["{\"city\": \"Oslo\"}}"],
        );
        assert_eq!(out, [call("get_weather", r#"{"city":"Oslo"}"#)]);
        // Cut short (max tokens): content.
        let out = scan("<tool_call>\n", &["{\"name\": \"get_w"]);
        assert_eq!(out, [text("<tool_call>\n{\"name\": \"get_w")]);
    }

    #[test]
    fn malformed_calls_are_content() {
        let out = scan(
            "",
            &["<tool_call>\n{not json}\n</tool_call> and <tool_call>{\"name\":\"f\"}</tool_call>"],
        );
        assert_eq!(
            out,
            [text(
                "<tool_call>\n{not json}\n</tool_call> and <tool_call>{\"name\":\"f\"}</tool_call>"
            )]
        );
        // No name: content too; arguments as a JSON text are parsed.
        assert_eq!(
            scan("", &["<tool_call>{\"arguments\": {}}</tool_call>"]),
            [text("<tool_call>{\"arguments\": {}}</tool_call>")]
        );
        assert_eq!(
            scan(
                "",
                &["<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>"]
            ),
            [call("f", r#"{"a":1}"#)]
        );
    }

    #[test]
    fn llama_answers_that_are_one_json_call() {
        let run = |pieces: &[&str]| {
            let mut s = CallScan::new(CallFormat::LlamaJson, vec!["f".into()]);
            let mut out: Vec<Piece> = pieces.iter().flat_map(|p| s.push(p)).collect();
            out.extend(s.finish());
            out
        };
        assert_eq!(
            run(&["{\"name\": \"f\", ", "\"parameters\": {\"a\": 1}}"]),
            [call("f", r#"{"a":1}"#)]
        );
        // Not JSON: content as it comes; JSON that is no call: content.
        let mut s = CallScan::new(CallFormat::LlamaJson, vec!["f".into()]);
        assert_eq!(s.push("  "), []);
        assert_eq!(s.push("Hi {"), [text("  Hi {")]);
        assert_eq!(run(&["{\"a\": 1}"]), [text("{\"a\": 1}")]);
    }

    #[test]
    fn a_bare_json_answer_naming_a_declared_tool_is_a_call() {
        // Qwen2.5-Coder's unforced call: the JSON without its tags.
        assert_eq!(
            scan(
                "",
                &[
                    "\n{\"name\": \"get_weather\", ",
                    "\"arguments\": {\"city\": \"Paris\"}}"
                ]
            ),
            [call("get_weather", r#"{"city":"Paris"}"#)]
        );
        // Another name, or text first: content.
        let other = "{\"name\": \"rm_rf\", \"arguments\": {}}";
        assert_eq!(scan("", &[other]), [text(other)]);
        assert_eq!(scan("", &["Try ", other]), [text(&format!("Try {other}"))]);
    }

    #[test]
    fn text_after_calls_is_content_and_whitespace_is_dropped() {
        let out = scan(
            "",
            &["  <tool_call>{\"name\": \"f\"}</tool_call>\n\nDone.\n"],
        );
        assert_eq!(out, [call("f", "{}"), text("Done.\n")]);
    }
}
