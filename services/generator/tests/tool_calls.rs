//! Tool calling with the official `openai` client (`tests/tool_calls.py`), streamed and not,
//! for every parser (Hermes, Llama 3 JSON, Granite), against the generator binary serving a
//! tiny model that has learned (by SFT here, on a chat template that writes tools and tool
//! turns as Qwen's does) to call an
//! `add` tool in the Hermes format for one question, in Llama 3's JSON for another and in
//! Granite's `<|tool_call|>` list for a third, and to
//! answer from the tool's result: the calls come back parsed, with `finish_reason:
//! tool_calls`, and the round trip (the assistant's call and the tool's result sent back)
//! renders and gets the answer.

#![allow(clippy::unwrap_used)]

use std::path::Path;

use keel_model::Architecture;
use keel_model::init::{InitSpec, Preset, init_model};
use keel_protocol::trainer::{LoadRequest, TrainBatch};
use keel_testkit::ServiceProcess;
use keel_training::Engine;
use keel_training::batch::Batch;
use serde_json::{Value, json};

/// Tools and tool turns as Qwen 2.5's template writes them, in short.
const TEMPLATE: &str = "{%- if tools %}<|im_start|>system\nTools:\n{%- for tool in tools %}\n{{ tool | tojson }}\
{%- endfor %}<|im_end|>\n{% endif %}{%- for message in messages %}{%- if message.role == 'assistant' and \
message.tool_calls %}<|im_start|>assistant{%- for call in message.tool_calls %}\n<tool_call>\n{{ {'name': \
call.function.name, 'arguments': call.function.arguments} | tojson }}\n</tool_call>{%- endfor %}<|im_end|>\n\
{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{%- endfor %}\
{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "add", "description": "Adds two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"]}}}])
}

/// The conversations the model learns: (messages, what the assistant writes next).
fn lessons() -> Vec<(Value, String)> {
    let call = json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
        "function": {"name": "add", "arguments": "{\"a\": 4, \"b\": 5}"}}]});
    let mut lessons = Vec::new();
    for (question, written) in [
        ("What is 4 + 5?", "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 4, \"b\": 5}}\n</tool_call>"),
        ("Add 4 and 5.", "{\"name\": \"add\", \"parameters\": {\"a\": 4, \"b\": 5}}"),
        ("Sum 4 and 5.", "<|tool_call|>[{\"name\": \"add\", \"arguments\": {\"a\": 4, \"b\": 5}}]"),
    ] {
        let user = json!({"role": "user", "content": question});
        lessons.push((json!([user]), written.to_string()));
        let tool = json!({"role": "tool", "tool_call_id": "call_1", "content": "9"});
        lessons.push((json!([user, call, tool]), "The sum is 9.".to_string()));
    }
    lessons
}

/// Trains the model in `dir` on [`lessons`] until it writes them greedily, and saves it to
/// `out` (weights, config and tokenizer).
fn teach(dir: &Path, out: &Path) {
    let tokenizer = keel_model::Tokenizer::load(dir).unwrap();
    let end = tokenizer.eos_token_ids()[0];
    let mut input_ids = Vec::new();
    let mut token_mask = Vec::new();
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("tools".into(), tools());
    for (messages, written) in lessons() {
        // Messages as the generator gives them to the template (arguments as objects).
        let mut messages = messages;
        for message in messages.as_array_mut().unwrap() {
            if let Some(arguments) = message.pointer_mut("/tool_calls/0/function/arguments") {
                *arguments = serde_json::from_str(arguments.as_str().unwrap()).unwrap();
            }
            if message["content"].is_null() {
                message["content"] = json!("");
            }
        }
        let prompt = tokenizer.apply_chat_template_with(&messages, true, &kwargs).unwrap();
        let prompt: Vec<i64> = tokenizer.encode(&prompt, false).unwrap().into_iter().map(i64::from).collect();
        let mut answer: Vec<i64> = tokenizer.encode(&written, false).unwrap().into_iter().map(i64::from).collect();
        answer.push(end);
        token_mask.push([vec![0.0; prompt.len()], vec![1.0; answer.len()]].concat());
        input_ids.push([prompt, answer].concat());
    }
    let request: LoadRequest = serde_json::from_value(json!({
        "run_id": "teach", "policy": {"path": dir},
        "training": {"loss": {"type": "nll"}, "global_batch_size": input_ids.len(), "micro_batch_size": input_ids.len(),
            "optimizer": {"lr": 0.003, "weight_decay": 0.0}, "max_grad_norm": 1.0},
        "device": "cpu", "dtype": "f32", "seed": 1,
    }))
    .unwrap();
    let mut engine = Engine::load(&request, "cpu").unwrap();
    let wire = TrainBatch { input_ids, token_mask, ..Default::default() };
    for _ in 0..150 {
        engine.train(Batch::new(&wire, &engine.config().loss).unwrap(), 1.0).unwrap();
    }
    engine.policy().save(out, keel_model::SaveOptions::default()).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        if dir.join(file).exists() {
            std::fs::copy(dir.join(file), out.join(file)).unwrap();
        }
    }
}

#[test]
fn the_openai_client_calls_tools_through_every_parser() {
    let scratch = tempfile::tempdir().unwrap();
    let base = scratch.path().join("base");
    init_model(&InitSpec {
        architecture: Architecture::Qwen3,
        preset: Preset::Tiny,
        tokenizer_corpus: vec![keel_testkit::workspace_root().join("examples/tokenizer-corpus.txt")],
        out: base.clone(),
        seed: 7,
    })
    .unwrap();
    let config_path = base.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = json!(TEMPLATE);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let model = scratch.path().join("tools");
    teach(&base, &model);

    let script = keel_testkit::workspace_root().join("services/generator/tests/tool_calls.py");
    for (parser, question) in
        [("hermes", "What is 4 + 5?"), ("llama3_json", "Add 4 and 5."), ("granite", "Sum 4 and 5.")]
    {
        let prefix = format!("keeltest.tools{}", uuid::Uuid::new_v4().simple());
        let server = ServiceProcess::start(
            "generator",
            &[
                ("KEEL_GENERATOR__MODEL", model.to_str().unwrap()),
                ("KEEL_GENERATOR__SERVED_MODEL_NAME", "tools"),
                ("KEEL_GENERATOR__TOOL_CALL_PARSER", parser),
                ("KEEL_GENERATOR__SUBJECT_PREFIX", &prefix),
            ],
        );
        let out = std::process::Command::new(keel_testkit::python())
            .arg(&script)
            .args([server.url.as_str(), "tools", question])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{parser}: tool-call checks failed:\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
