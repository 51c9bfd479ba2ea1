//! Chat: messages, and the model's own chat template (`tokenizer.chat_template`,
//! Jinja) rendered with `minijinja` the way Hugging Face, llama.cpp `--jinja`,
//! Ollama and vLLM render it: `trim_blocks` and `lstrip_blocks` on, the
//! variables `messages` (`role`, `content`), `add_generation_prompt`,
//! `bos_token`, `eos_token`, and the helpers real templates call
//! (`raise_exception`, `strftime_now`, a Python-style `tojson`, Python string
//! methods such as `.strip()` through `minijinja-contrib`'s pycompat).
//!
//! **Where the message contents are.** A message's content is user text and
//! must be tokenized as plain text (a user who types `<|im_end|>` must not end
//! the turn), while the template's own control tokens become their ids. The
//! template is rendered twice: once with the real contents, once with each
//! content replaced by a private-use marker. Putting the contents (verbatim,
//! or trimmed, as Gemma's and Llama's templates do) back in place of the
//! markers must give the real rendering exactly; the markers' places are then
//! the content spans, which the special-token partition never cuts control
//! tokens out of. If it does not match (a template that rewrites contents),
//! contents without special-token text are still safe to parse; contents with
//! special-token text are refused with an error rather than risk injection.

use super::vocab::err;
use crate::{ModelError, Result};
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind, UndefinedBehavior};
use std::sync::Arc;

/// The Qwen2.5 chat template exactly as the Qwen2.5(-Coder) GGUFs carry it
/// (`tokenizer.chat_template`): ChatML with Qwen's default system prompt and
/// tool turns. For tiny test models and operators who want ChatML.
pub const QWEN2_CHAT_TEMPLATE: &str = include_str!("qwen2_chat_template.jinja");

/// Who speaks a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    /// A tool's answer.
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "system" => Ok(Self::System),
            "user" => Ok(Self::User),
            "assistant" => Ok(Self::Assistant),
            "tool" => Ok(Self::Tool),
            other => Err(ModelError::InvalidArgument(format!(
                "unknown chat role `{other}` (expected system, user, assistant or tool)"
            ))),
        }
    }
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
        }
    }
    pub fn system(content: impl Into<String>) -> Self {
        Self::new(Role::System, content)
    }
    pub fn user(content: impl Into<String>) -> Self {
        Self::new(Role::User, content)
    }
    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new(Role::Assistant, content)
    }
}

#[derive(serde::Serialize)]
struct Msg<'a> {
    role: &'static str,
    content: &'a str,
}

/// A compiled-on-demand Jinja chat template with its environment.
pub(crate) struct ChatTemplate {
    source: Arc<str>,
    env: Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("len", &self.source.len())
            .finish()
    }
}

/// The rendered conversation and the byte ranges of message contents in it.
#[derive(Debug)]
pub(crate) struct Rendered {
    pub text: String,
    pub contents: Vec<(usize, usize)>,
}

const MARK_OPEN: char = '\u{E000}';
const MARK_CLOSE: char = '\u{E001}';

impl ChatTemplate {
    pub(crate) fn new(source: &str) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        // `messages[0]['role']` on an empty conversation is undefined, not an
        // error (the Qwen2.5 template reads it unconditionally).
        env.set_undefined_behavior(UndefinedBehavior::Chainable);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // Compile once now so a broken template fails at load, not at chat.
        env.template_from_str(source)
            .map_err(|e| err(format!("chat template does not compile: {e}")))?;
        Ok(Self {
            source: Arc::from(source),
            env,
        })
    }

    pub(crate) fn source(&self) -> &str {
        &self.source
    }

    fn render_with(
        &self,
        messages: &[Msg<'_>],
        add_generation_prompt: bool,
        bos: &str,
        eos: &str,
    ) -> Result<String> {
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos,
            eos_token => eos,
        };
        self.env
            .render_str(&self.source, ctx)
            .map_err(|e| ModelError::ChatTemplate(format!("{e:#}")))
    }

    /// Render `messages` and locate their contents (see the module docs).
    /// `has_special(content)` says whether a content holds special-token text.
    pub(crate) fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos: &str,
        eos: &str,
        has_special: impl Fn(&str) -> bool,
    ) -> Result<Rendered> {
        let real: Vec<Msg<'_>> = messages
            .iter()
            .map(|m| Msg {
                role: m.role.as_str(),
                content: &m.content,
            })
            .collect();
        let text = self.render_with(&real, add_generation_prompt, bos, eos)?;
        let markers: Vec<String> = (0..messages.len())
            .map(|i| format!("{MARK_OPEN}{i}{MARK_CLOSE}"))
            .collect();
        let marked: Vec<Msg<'_>> = messages
            .iter()
            .zip(&markers)
            .map(|(m, mk)| Msg {
                role: m.role.as_str(),
                content: mk,
            })
            .collect();
        let with_markers = self.render_with(&marked, add_generation_prompt, bos, eos);
        if let Ok(p) = with_markers {
            for trim in [false, true] {
                if let Some((s, spans)) = substitute(&p, messages, trim) {
                    if s == text {
                        return Ok(Rendered {
                            text,
                            contents: spans,
                        });
                    }
                }
            }
        }
        if let Some(i) = messages.iter().position(|m| has_special(&m.content)) {
            return Err(ModelError::ChatTemplate(format!(
                "message {i} contains special-token text and the chat template rewrites message \
                 contents, so they cannot be kept apart from the template's own tokens"
            )));
        }
        Ok(Rendered {
            text,
            contents: Vec::new(),
        })
    }
}

/// Replace the markers of `p` by the message contents (trimmed or not);
/// returns the text and the content spans, or `None` for a stray marker.
fn substitute(
    p: &str,
    messages: &[ChatMessage],
    trim: bool,
) -> Option<(String, Vec<(usize, usize)>)> {
    let mut out =
        String::with_capacity(p.len() + messages.iter().map(|m| m.content.len()).sum::<usize>());
    let mut spans = Vec::new();
    let mut rest = p;
    while let Some(open) = rest.find(MARK_OPEN) {
        out.push_str(&rest[..open]);
        let after = &rest[open + MARK_OPEN.len_utf8()..];
        let close = after.find(MARK_CLOSE)?;
        let i: usize = after[..close].parse().ok()?;
        let content = messages.get(i)?.content.as_str();
        let content = if trim { content.trim() } else { content };
        spans.push((out.len(), out.len() + content.len()));
        out.push_str(content);
        rest = &after[close + MARK_CLOSE.len_utf8()..];
    }
    out.push_str(rest);
    Some((out, spans))
}

fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(format)`: the current UTC time (llama.cpp and vLLM use local
/// time; a device has none it should leak). Supports `%Y %y %m %d %e %B %b %A
/// %a %H %M %S %j %%`.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    Ok(strftime(&format, secs))
}

/// Format a UNIX time (UTC) with a subset of `strftime`.
pub(crate) fn strftime(format: &str, unix_secs: u64) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
    ];
    let days = unix_secs / 86_400;
    let rem = unix_secs % 86_400;
    let (h, mi, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(m - 1) as usize] + d + i64::from(leap && m > 2);
    let month = MONTHS[(m - 1) as usize];
    let weekday = DAYS[(days % 7) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&y.to_string()),
            Some('y') => out.push_str(&format!("{:02}", y.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{m:02}")),
            Some('d') => out.push_str(&format!("{d:02}")),
            Some('e') => out.push_str(&format!("{d:>2}")),
            Some('B') => out.push_str(month),
            Some('b') => out.push_str(&month[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{h:02}")),
            Some('M') => out.push_str(&format!("{mi:02}")),
            Some('S') => out.push_str(&format!("{s:02}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Python's `json.dumps(value, ensure_ascii=False)` (Hugging Face's
/// `tojson`): `", "` and `": "` separators, or `indent`.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    write_json(&json, indent, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

fn write_json(v: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value as J;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, x) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        J::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (k, x)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                out.push_str(&serde_json::Value::String(k.clone()).to_string());
                out.push_str(": ");
                write_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_formats_a_known_date() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %H:%M:%S %j %y %%", t),
            "Friday July 26 13:05:09 208 24 %"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
    }

    #[test]
    fn templates_get_python_helpers() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m.role }}:{{ m.content.strip() | upper }}\
             {% if m.content.startswith(' x') %}!{% endif %}|{% endfor %}\
             {{ {'a': [1, 'é<'], 'b': none} | tojson }}",
        )
        .unwrap();
        let r = t
            .render(&[ChatMessage::user(" xy ")], false, "<s>", "</s>", |_| {
                false
            })
            .unwrap();
        assert_eq!(r.text, "<s>user:XY!|{\"a\": [1, \"é<\"], \"b\": null}");
        let t = ChatTemplate::new("{{ raise_exception('no system role') }}").unwrap();
        let e = t.render(&[], false, "", "", |_| false).unwrap_err();
        assert!(e.to_string().contains("no system role"), "{e}");
        assert!(ChatTemplate::new("{% if %}").is_err());
    }

    #[test]
    fn contents_are_located_verbatim_or_trimmed() {
        let t = ChatTemplate::new(
            "{% for m in messages %}<t>{{ m.role }}\n{{ m.content | trim }}</t>{% endfor %}",
        )
        .unwrap();
        let msgs = [ChatMessage::user(" a<t> "), ChatMessage::assistant("user")];
        let r = t.render(&msgs, false, "", "", |_| true).unwrap();
        assert_eq!(r.text, "<t>user\na<t></t><t>assistant\nuser</t>");
        let spans: Vec<&str> = r.contents.iter().map(|&(s, e)| &r.text[s..e]).collect();
        assert_eq!(spans, ["a<t>", "user"]);
        assert_eq!(r.contents[1].0, r.text.rfind("user").unwrap());

        // A template that rewrites contents: refused when they hold specials.
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ m.content | replace('a', 'b') }}{% endfor %}",
        )
        .unwrap();
        assert!(t
            .render(&msgs, false, "", "", |c| c.contains("<t>"))
            .is_err());
        let r = t
            .render(&[ChatMessage::user("aa")], false, "", "", |_| false)
            .unwrap();
        assert_eq!((r.text.as_str(), r.contents.len()), ("bb", 0));
    }
}
