//! Structured output in requests (docs/api.md, "Structured output"): what
//! `response_format` asks the output to be ([`response_format`]: a JSON
//! object, a JSON schema, or, as an extension, a Lark or regex grammar), and
//! the grammar of a forced tool call's arguments ([`forced_call`]: the
//! called function's parameter schema), and the lazy grammar of the calls
//! a model may make under `tool_choice: "auto"` ([`lazy_call`]). Each
//! becomes a
//! `tandem_grammar::GrammarSpec`, compiled against the tokenizer by the
//! worker (a grammar that does not compile is a 400 naming its parameter,
//! before anything is generated).

use serde_json::{Map, Value};
use tandem_grammar::{GrammarSpec, Trigger};

use super::error::ApiError;
use super::tools::{CallFormat, ToolChoice, Tools};

/// What a request constrains its output to, and the parameter that asked.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputFormat {
    pub spec: GrammarSpec,
    /// `response_format`, or `tools` for a forced call's arguments.
    pub param: &'static str,
}

/// `response_format` ([`GrammarSpec::from_response_format`]: text, json_object,
/// json_schema, and the extension `{"type": "grammar", "syntax": "lark" |
/// "regex", "definition": "…"}`), each refusal naming its parameter.
pub fn response_format(o: &Map<String, Value>) -> Result<Option<OutputFormat>, ApiError> {
    const P: &str = "response_format";
    let Some(v) = o.get(P).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    match GrammarSpec::from_response_format(v) {
        Ok(spec) => Ok(spec.map(|spec| OutputFormat { spec, param: P })),
        Err(e) if e.unsupported => Err(ApiError::unsupported(&e.param, &e.message)),
        Err(e) => Err(ApiError::invalid(e.message, Some(&e.param))),
    }
}

/// A function's parameter schema (any JSON object when it declares none).
fn parameters(def: &Value) -> Value {
    match def["function"].get("parameters") {
        Some(p @ Value::Object(_)) => p.clone(),
        _ => serde_json::json!({"type": "object"}),
    }
}

/// `%json {…}` of a schema in a Lark grammar (with the whitespace JSON
/// schemas get: `tandem_grammar::json_options`).
fn json_rule(schema: &Value) -> String {
    format!("%json {}", tandem_grammar::json_options(schema.clone()))
}

/// A Lark string literal of `s` (JSON's escapes are Lark's).
fn lit(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `%json` of one call of any declared tool: `{"name": <a declared name>,
/// "<args>": <that function's parameters>}`, the name first.
fn any_call(tools: &Tools, args: &str) -> String {
    let calls: Vec<Value> = tools
        .defs
        .iter()
        .filter_map(|d| {
            let name = d["function"]["name"].as_str()?;
            let mut properties = Map::new();
            properties.insert("name".into(), serde_json::json!({"const": name}));
            properties.insert(args.into(), parameters(d));
            Some(serde_json::json!({
                "type": "object",
                "properties": properties,
                "required": ["name", args],
                "additionalProperties": false,
            }))
        })
        .collect();
    json_rule(&serde_json::json!({"anyOf": calls}))
}

/// The lazy grammar of `tool_choice: "auto"` (docs/api.md "Tools"): the
/// model writes freely until it starts a call, and the call is then
/// constrained as a forced one is (the name one of the declared tools, the
/// arguments valid against its parameter schema, then the call's close,
/// further calls when parallel calls are allowed, and the end). A call
/// starts at `<tool_call>` anywhere (Hermes), or at an answer that opens
/// with `{"name": "NAME"` for a declared NAME (the bare JSON call Hermes
/// models also write, and Llama 3.x's only form), as llama.cpp's lazy
/// grammars trigger. `None` unless the choice is `auto`.
pub fn lazy_call(format: CallFormat, tools: &Tools) -> Option<OutputFormat> {
    if tools.choice != ToolChoice::Auto {
        return None;
    }
    let mut triggers: Vec<Trigger> = tools
        .names()
        .iter()
        .map(|n| Trigger {
            word: format!("{{\"name\": {}", lit(n)),
            at_start: true,
        })
        .collect();
    let lark = match format {
        CallFormat::Hermes => {
            triggers.insert(
                0,
                Trigger {
                    word: "<tool_call>".into(),
                    at_start: false,
                },
            );
            let (open, close) = (lit("<tool_call>\n"), lit("\n</tool_call>"));
            let tagged = if tools.allows_several_calls() {
                let between = lit("\n</tool_call>\n<tool_call>\n");
                format!("{open} call ({between} call)* {close}")
            } else {
                format!("{open} call {close}")
            };
            format!(
                "start: tagged | call\ntagged: {tagged}\ncall: {}\n",
                any_call(tools, "arguments")
            )
        }
        CallFormat::LlamaJson => format!("start: {}\n", any_call(tools, "parameters")),
    };
    Some(OutputFormat {
        spec: GrammarSpec::Lazy { triggers, lark },
        param: "tools",
    })
}

/// The grammar of what the model writes after a forced call's prefix
/// ([`CallFormat::forced_prefix`]): the rest of the call, its arguments
/// valid against the called function's parameter schema. Under Hermes
/// (`<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`) with
/// `required` and parallel calls allowed, more calls may follow. `None`
/// when no call is forced.
pub fn forced_call(format: CallFormat, tools: &Tools) -> Option<OutputFormat> {
    let def_of = |name: &str| {
        tools
            .defs
            .iter()
            .find(|d| d["function"]["name"].as_str() == Some(name))
    };
    let lark = match (format, &tools.choice) {
        (_, ToolChoice::Auto | ToolChoice::None) => return None,
        (CallFormat::Hermes, ToolChoice::Function(n)) => {
            let args = parameters(def_of(n)?);
            format!("start: {} {}\n", json_rule(&args), lit("}\n</tool_call>"))
        }
        (CallFormat::Hermes, ToolChoice::Required) => {
            let call = any_call(tools, "arguments");
            let close = lit("\n</tool_call>");
            if tools.allows_several_calls() {
                let between = lit("\n</tool_call>\n<tool_call>\n");
                format!("start: call ({between} call)* {close}\ncall: {call}\n")
            } else {
                format!("start: {call} {close}\n")
            }
        }
        (CallFormat::LlamaJson, ToolChoice::Function(n)) => {
            let args = parameters(def_of(n)?);
            format!("start: {} {}\n", json_rule(&args), lit("}"))
        }
        (CallFormat::LlamaJson, ToolChoice::Required) => {
            // The prefix opened the name's string.
            let alts: Vec<String> = tools
                .defs
                .iter()
                .filter_map(|d| {
                    let name = d["function"]["name"].as_str()?;
                    let head = lit(&format!("{name}\", \"parameters\": "));
                    Some(format!("{head} {} {}", json_rule(&parameters(d)), lit("}")))
                })
                .collect();
            format!("start: {}\n", alts.join(" | "))
        }
    };
    Some(OutputFormat {
        spec: GrammarSpec::Lark(lark),
        param: "tools",
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<OutputFormat>, ApiError> {
        response_format(v.as_object().unwrap())
    }

    #[test]
    fn response_formats_become_grammar_specs() {
        assert_eq!(parse(json!({})).unwrap(), None);
        assert_eq!(
            parse(json!({"response_format": {"type": "text"}})).unwrap(),
            None
        );
        let spec = |v| parse(v).unwrap().unwrap().spec;
        assert_eq!(
            spec(json!({"response_format": {"type": "json_object"}})),
            GrammarSpec::JsonObject
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(
            spec(json!({"response_format": {"type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": true}}})),
            GrammarSpec::JsonSchema(schema)
        );
        assert_eq!(
            spec(
                json!({"response_format": {"type": "grammar", "syntax": "regex",
                "definition": "[0-9]+"}})
            ),
            GrammarSpec::Regex("[0-9]+".into())
        );
        assert_eq!(
            spec(
                json!({"response_format": {"type": "grammar", "syntax": "lark",
                "definition": "start: \"a\""}})
            ),
            GrammarSpec::Lark("start: \"a\"".into())
        );
        for (bad, param) in [
            (json!({"response_format": "json"}), "response_format"),
            (
                json!({"response_format": {"type": "xml"}}),
                "response_format.type",
            ),
            (
                json!({"response_format": {"type": "json_schema"}}),
                "response_format.json_schema",
            ),
            (
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
                "response_format.json_schema.name",
            ),
            (
                json!({"response_format": {"type": "json_schema",
                    "json_schema": {"name": "x", "schema": [1]}}}),
                "response_format.json_schema.schema",
            ),
            (
                json!({"response_format": {"type": "grammar", "syntax": "ebnf",
                    "definition": "x"}}),
                "response_format.syntax",
            ),
        ] {
            let e = parse(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {e:?}");
        }
    }
}
