//! Tools (function calling) in chat requests: `tools`, `tool_choice`,
//! `parallel_tool_calls`, and the `tool_calls` / `tool_call_id` fields of
//! history messages, validated into [`Tools`] and [`ToolCall`]s (each
//! refusal names its parameter), and the call format of the model's chat
//! template ([`CallFormat`]): what opens a call, and what the prompt gets
//! appended when a call is forced.

use serde_json::{Map, Value};
use tandem_model::tokenizer::ToolCall;

use super::error::ApiError;

/// Most tools one request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// Most tool calls one history message may carry.
pub const MAX_CALLS_PER_MESSAGE: usize = 128;

/// Longest tool call id or history function name accepted (bytes).
const MAX_ID_LEN: usize = 256;

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default with tools).
    Auto,
    /// No call: the tools are not offered.
    None,
    /// At least one call.
    Required,
    /// A call of this function.
    Function(String),
}

/// The tools of a chat request.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// `{"type": "function", "function": {"name", "description"?,
    /// "parameters"?}}` each: what the chat template gets.
    pub defs: Vec<Value>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true); a named `tool_choice` gives
    /// one call whatever it says.
    pub parallel: bool,
}

impl Tools {
    /// The tools the chat template gets: none with `tool_choice: "none"`.
    pub fn offered(&self) -> &[Value] {
        match self.choice {
            ToolChoice::None => &[],
            _ => &self.defs,
        }
    }

    /// The declared functions' names.
    pub fn names(&self) -> Vec<String> {
        self.defs
            .iter()
            .filter_map(|d| d["function"]["name"].as_str().map(str::to_string))
            .collect()
    }

    /// Whether the output is parsed for calls.
    pub fn parses_calls(&self) -> bool {
        !self.offered().is_empty()
    }

    /// Whether the model may make more than one call.
    pub fn allows_several_calls(&self) -> bool {
        self.parallel && !matches!(self.choice, ToolChoice::Function(_))
    }
}

fn type_error(param: &str, expected: &str) -> ApiError {
    ApiError::invalid(format!("`{param}` must be {expected}"), Some(param))
}

/// OpenAI's rule for function names: `^[a-zA-Z0-9_-]{1,64}$`. It also keeps
/// a name safe to put into a forced call's JSON and into the prompt.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// `tools[i]`: a function tool, normalised to the fields templates read.
fn tool_def(i: usize, v: &Value) -> Result<(String, Value), ApiError> {
    let param = format!("tools[{i}]");
    let Some(t) = v.as_object() else {
        return Err(type_error(&param, "an object {type, function}"));
    };
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(ApiError::unsupported(
                &format!("{param}.type"),
                &format!("tools of type `{other}` (only `function`)"),
            ))
        }
        None => return Err(type_error(&format!("{param}.type"), "\"function\"")),
    }
    let Some(f) = t.get("function").and_then(Value::as_object) else {
        return Err(type_error(
            &format!("{param}.function"),
            "an object {name, description, parameters}",
        ));
    };
    let name = match f.get("name") {
        Some(Value::String(n)) if valid_function_name(n) => n.clone(),
        _ => {
            return Err(type_error(
                &format!("{param}.function.name"),
                "a string of 1 to 64 letters, digits, `_` or `-`",
            ))
        }
    };
    let mut function = Map::new();
    function.insert("name".into(), Value::String(name.clone()));
    match f.get("description") {
        None | Some(Value::Null) => {}
        Some(Value::String(d)) => {
            function.insert("description".into(), Value::String(d.clone()));
        }
        Some(_) => {
            return Err(type_error(
                &format!("{param}.function.description"),
                "a string",
            ))
        }
    }
    match f.get("parameters") {
        None | Some(Value::Null) => {}
        Some(p @ Value::Object(_)) => {
            function.insert("parameters".into(), p.clone());
        }
        Some(_) => {
            return Err(type_error(
                &format!("{param}.function.parameters"),
                "a JSON schema object",
            ))
        }
    }
    // A forced call's arguments always follow the parameter schema
    // (`super::format::forced_call`); `strict` changes nothing else.
    match f.get("strict") {
        None | Some(Value::Null) | Some(Value::Bool(_)) => {}
        Some(_) => return Err(type_error(&format!("{param}.function.strict"), "a boolean")),
    }
    let def = serde_json::json!({"type": "function", "function": Value::Object(function)});
    Ok((name, def))
}

/// `tool_choice`, checked against the declared tool names.
fn tool_choice(o: &Map<String, Value>, names: &[String]) -> Result<ToolChoice, ApiError> {
    let choice = match o.get("tool_choice") {
        None | Some(Value::Null) => return Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    format!(
                        "`tool_choice` must be \"none\", \"auto\", \"required\" or \
                         {{\"type\": \"function\", \"function\": {{\"name\": …}}}} (got {other:?})"
                    ),
                    Some("tool_choice"),
                ))
            }
        },
        Some(Value::Object(c)) => {
            let name = c
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            match (c.get("type").and_then(Value::as_str), name) {
                (Some("function"), Some(n)) => ToolChoice::Function(n.to_string()),
                _ => {
                    return Err(type_error(
                        "tool_choice",
                        "{\"type\": \"function\", \"function\": {\"name\": …}}",
                    ))
                }
            }
        }
        Some(_) => return Err(type_error("tool_choice", "a string or an object")),
    };
    match &choice {
        ToolChoice::Required if names.is_empty() => Err(ApiError::invalid(
            "`tool_choice` \"required\" needs `tools`",
            Some("tool_choice"),
        )),
        ToolChoice::Function(n) if !names.contains(n) => Err(ApiError::invalid(
            format!("`tool_choice` names the function {n:?}, which is not among `tools`"),
            Some("tool_choice"),
        )),
        _ => Ok(choice),
    }
}

/// `tools`, `tool_choice` and `parallel_tool_calls` of a chat request;
/// `None` without tools (a `tool_choice` of `auto` or `none` then passes,
/// as with OpenAI).
pub fn parse_tools(o: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let arr = match o.get("tools") {
        None | Some(Value::Null) => &Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(type_error("tools", "an array of function tools")),
    };
    if arr.len() > MAX_TOOLS {
        return Err(ApiError::invalid(
            format!(
                "`tools` has {} entries; at most {MAX_TOOLS} are accepted",
                arr.len()
            ),
            Some("tools"),
        ));
    }
    let mut names: Vec<String> = Vec::with_capacity(arr.len());
    let mut defs = Vec::with_capacity(arr.len());
    for (i, t) in arr.iter().enumerate() {
        let (name, def) = tool_def(i, t)?;
        if names.contains(&name) {
            return Err(ApiError::invalid(
                format!("`tools` declares the function {name:?} twice"),
                Some(&format!("tools[{i}].function.name")),
            ));
        }
        names.push(name);
        defs.push(def);
    }
    let choice = tool_choice(o, &names)?;
    let parallel = match o.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(type_error("parallel_tool_calls", "a boolean")),
    };
    Ok((!defs.is_empty()).then_some(Tools {
        defs,
        choice,
        parallel,
    }))
}

/// A string field of a history tool call: non-empty, bounded.
fn call_string(c: &Map<String, Value>, k: &str, param: &str) -> Result<String, ApiError> {
    match c.get(k) {
        Some(Value::String(s)) if !s.is_empty() && s.len() <= MAX_ID_LEN => Ok(s.clone()),
        _ => Err(type_error(
            &format!("{param}.{k}"),
            &format!("a non-empty string of at most {MAX_ID_LEN} bytes"),
        )),
    }
}

/// `messages[i].tool_calls[j]`: `{id, type: "function", function: {name,
/// arguments}}`, the arguments a JSON text (OpenAI's shape; a JSON object
/// is accepted too) parsed into the value the template gets.
fn history_call(param: &str, v: &Value) -> Result<ToolCall, ApiError> {
    let Some(c) = v.as_object() else {
        return Err(type_error(param, "an object {id, type, function}"));
    };
    let id = call_string(c, "id", param)?;
    if !matches!(c.get("type"), None | Some(Value::Null))
        && c.get("type").and_then(Value::as_str) != Some("function")
    {
        return Err(type_error(&format!("{param}.type"), "\"function\""));
    }
    let Some(f) = c.get("function").and_then(Value::as_object) else {
        return Err(type_error(
            &format!("{param}.function"),
            "an object {name, arguments}",
        ));
    };
    let fparam = format!("{param}.function");
    let name = call_string(f, "name", &fparam)?;
    let aparam = format!("{fparam}.arguments");
    let arguments = match f.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| {
            ApiError::invalid(format!("`{aparam}` is not valid JSON: {e}"), Some(&aparam))
        })?,
        Some(a @ Value::Object(_)) => a.clone(),
        _ => return Err(type_error(&aparam, "a JSON text (string)")),
    };
    Ok(ToolCall {
        id,
        name,
        arguments,
    })
}

/// `messages[i].tool_calls` (assistant messages only); empty when absent or
/// null.
pub fn history_calls(
    i: usize,
    m: &Map<String, Value>,
    assistant: bool,
) -> Result<Vec<ToolCall>, ApiError> {
    let param = format!("messages[{i}].tool_calls");
    let arr = match m.get("tool_calls") {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(a)) if a.is_empty() => return Ok(Vec::new()),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(type_error(&param, "an array of tool calls")),
    };
    if !assistant {
        return Err(ApiError::invalid(
            format!("`{param}` is only allowed in assistant messages"),
            Some(&param),
        ));
    }
    if arr.len() > MAX_CALLS_PER_MESSAGE {
        return Err(ApiError::invalid(
            format!("`{param}` has more than {MAX_CALLS_PER_MESSAGE} calls"),
            Some(&param),
        ));
    }
    arr.iter()
        .enumerate()
        .map(|(j, c)| history_call(&format!("{param}[{j}]"), c))
        .collect()
}

/// `messages[i].tool_call_id`: required in `tool` messages, refused in the
/// others.
pub fn tool_call_id(
    i: usize,
    m: &Map<String, Value>,
    tool: bool,
) -> Result<Option<String>, ApiError> {
    let param = format!("messages[{i}].tool_call_id");
    match (m.get("tool_call_id"), tool) {
        (None | Some(Value::Null), false) => Ok(None),
        (Some(Value::String(s)), true) if !s.is_empty() && s.len() <= MAX_ID_LEN => {
            Ok(Some(s.clone()))
        }
        (_, true) => Err(ApiError::invalid(
            format!(
                "a `tool` message needs `tool_call_id`, a non-empty string of at most \
                 {MAX_ID_LEN} bytes"
            ),
            Some(&param),
        )),
        (Some(_), false) => Err(ApiError::invalid(
            format!("`{param}` is only allowed in tool messages"),
            Some(&param),
        )),
    }
}

/// How a chat template's model writes a tool call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallFormat {
    /// Qwen2.5, Qwen3, Hermes: `<tool_call>\n{"name": …, "arguments":
    /// {…}}\n</tool_call>`, one or several.
    Hermes,
    /// Llama 3.1–3.3 (JSON-based tool calling): the whole answer is one
    /// `{"name": …, "parameters": {…}}` object.
    LlamaJson,
}

impl CallFormat {
    /// The format a chat template shows its model, if this server knows it.
    pub fn of_template(template: &str) -> Option<Self> {
        if template.contains(HERMES_OPEN) {
            Some(Self::Hermes)
        } else if template.contains(LLAMA_JSON_INSTRUCTION) {
            Some(Self::LlamaJson)
        } else {
            None
        }
    }

    /// The texts that open and close a call; `None` when a call is a bare
    /// JSON object that makes up the whole answer.
    pub fn tags(self) -> Option<(&'static str, &'static str)> {
        match self {
            Self::Hermes => Some((HERMES_OPEN, HERMES_CLOSE)),
            Self::LlamaJson => None,
        }
    }

    /// What the prompt gets after the template's generation prompt so that
    /// the model's continuation is a call (`required`) or a call of `name`:
    /// the target continues a fixed prefix, so greedy identity holds. Empty
    /// for `auto` and `none`.
    pub fn forced_prefix(self, choice: &ToolChoice) -> String {
        let name = |n: &str| Value::String(n.to_string());
        match (self, choice) {
            (_, ToolChoice::Auto | ToolChoice::None) => String::new(),
            (Self::Hermes, ToolChoice::Required) => format!("{HERMES_OPEN}\n"),
            (Self::Hermes, ToolChoice::Function(n)) => {
                format!("{HERMES_OPEN}\n{{\"name\": {}, \"arguments\": ", name(n))
            }
            (Self::LlamaJson, ToolChoice::Required) => "{\"name\": \"".to_string(),
            (Self::LlamaJson, ToolChoice::Function(n)) => {
                format!("{{\"name\": {}, \"parameters\": ", name(n))
            }
        }
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
/// What Llama 3.x's templates tell the model (their JSON call format).
const LLAMA_JSON_INSTRUCTION: &str = "\"parameters\": dictionary of argument name";

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<Tools>, ApiError> {
        parse_tools(v.as_object().unwrap())
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "d",
            "parameters": {"type": "object"}, "strict": false}})
    }

    #[test]
    fn tools_and_choices_are_validated() {
        let t = parse(json!({"tools": [weather()], "tool_choice": "required"}))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Required);
        assert_eq!(
            t.defs[0],
            json!({"type": "function", "function": {"name": "get_weather", "description": "d",
                "parameters": {"type": "object"}}})
        );
        assert!(t.parses_calls() && t.allows_several_calls());
        let t = parse(json!({"tools": [weather()], "tool_choice": "none"}))
            .unwrap()
            .unwrap();
        assert!(t.offered().is_empty() && !t.parses_calls());
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let t = parse(json!({"tools": [weather()], "tool_choice": named}))
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Function("get_weather".into()));
        assert!(!t.allows_several_calls());
        assert_eq!(parse(json!({"tool_choice": "auto"})).unwrap(), None);
        let refused = [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [1]}), "tools[0]"),
            (json!({"tools": [{"type": "web"}]}), "tools[0].type"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools[0].function.name",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": 1}}]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "strict": 1}}]}),
                "tools[0].function.strict",
            ),
            (
                json!({"tools": [weather(), weather()]}),
                "tools[1].function.name",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": "any"}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "x"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
                "parallel_tool_calls",
            ),
        ];
        for (body, param) in refused {
            let e = parse(body.clone()).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e:?}");
        }
    }

    #[test]
    fn history_calls_parse_their_arguments() {
        let m = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
            "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]});
        let calls = history_calls(2, m.as_object().unwrap(), true).unwrap();
        assert_eq!(
            calls,
            [ToolCall {
                id: "call_1".into(),
                name: "get_weather".into(),
                arguments: json!({"city": "Oslo"})
            }]
        );
        assert!(history_calls(2, m.as_object().unwrap(), false).is_err());
        let bad = json!({"tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]});
        let e = history_calls(1, bad.as_object().unwrap(), true).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[1].tool_calls[0].function.arguments")
        );
        let no_id = json!({"tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]});
        let e = history_calls(1, no_id.as_object().unwrap(), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[1].tool_calls[0].id"));
        let t = json!({"tool_call_id": "call_1"});
        assert_eq!(
            tool_call_id(3, t.as_object().unwrap(), true).unwrap(),
            Some("call_1".into())
        );
        assert!(tool_call_id(3, t.as_object().unwrap(), false).is_err());
        let e = tool_call_id(3, json!({}).as_object().unwrap(), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[3].tool_call_id"));
    }

    #[test]
    fn forced_prefixes_open_a_call() {
        let f = CallFormat::of_template("... <tool_call> ...").unwrap();
        assert_eq!(f.forced_prefix(&ToolChoice::Required), "<tool_call>\n");
        assert_eq!(
            f.forced_prefix(&ToolChoice::Function("get_weather".into())),
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
        );
        assert_eq!(f.forced_prefix(&ToolChoice::Auto), "");
        assert_eq!(CallFormat::of_template("{{ tools }}"), None);
        let llama = CallFormat::of_template(
            "Respond in the format {\"name\": function name, \"parameters\": dictionary of \
             argument name and its value}.",
        )
        .unwrap();
        assert_eq!(llama, CallFormat::LlamaJson);
        assert_eq!(
            llama.forced_prefix(&ToolChoice::Function("f".into())),
            "{\"name\": \"f\", \"parameters\": "
        );
        assert_eq!(llama.forced_prefix(&ToolChoice::Required), "{\"name\": \"");
    }
}
