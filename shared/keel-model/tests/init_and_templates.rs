//! A model made by `keel model init` is a complete HF directory: transformers loads it and
//! scores the same, tokenizes the same, and renders its chat template the same. Other
//! templates with the Jinja features real chat templates use render as Jinja2 does.

#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};

use common::{keel_logprobs, load_f32};
use keel_model::init::{InitSpec, Preset, init_model};
use keel_model::{Architecture, Tokenizer};
use keel_testkit::{max_abs_diff, reference, reference_logprobs, workspace_root};
use serde_json::{Value, json};

fn corpus() -> PathBuf {
    workspace_root().join("examples/tokenizer-corpus.txt")
}

fn init(arch: Architecture, out: &Path) {
    init_model(&InitSpec {
        architecture: arch,
        preset: Preset::Tiny,
        tokenizer_corpus: vec![corpus()],
        out: out.into(),
        seed: 3,
    })
    .expect("init model");
}

fn conversation() -> Value {
    json!([
        {"role": "system", "content": "You are a careful calculator."},
        {"role": "user", "content": "What is 12 + 30?"},
        {"role": "assistant", "content": "The answer is 42."},
        {"role": "user", "content": "And 7 * 6?"},
    ])
}

fn check_init(arch: Architecture) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model");
    init(arch, &out);
    for file in
        ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    {
        assert!(out.join(file).is_file(), "{file} missing");
    }

    let tokenizer = Tokenizer::load(&out).unwrap();
    let messages = dir.path().join("messages.json");
    std::fs::write(&messages, conversation().to_string()).unwrap();
    for add_generation_prompt in [false, true] {
        let mut args = vec!["render", out.to_str().unwrap(), messages.to_str().unwrap()];
        if add_generation_prompt {
            args.push("--add-generation-prompt");
        }
        let expected = reference(&args)["text"].as_str().unwrap().to_string();
        assert_eq!(tokenizer.apply_chat_template(&conversation(), add_generation_prompt).unwrap(), expected);
    }

    let text = tokenizer.apply_chat_template(&conversation(), true).unwrap();
    let ids: Vec<i64> = tokenizer.encode(&text, false).unwrap().into_iter().map(i64::from).collect();
    let expected_ids: Vec<i64> =
        serde_json::from_value(reference(&["tokenize", out.to_str().unwrap(), &text])["ids"].clone()).unwrap();
    assert_eq!(ids, expected_ids, "tokenization differs");
    assert!(
        ids.contains(&i64::from(tokenizer.token_to_id("<|im_start|>").unwrap())),
        "special tokens must be single tokens"
    );

    let model = load_f32(&out);
    let seqs = vec![ids.clone(), ids[..7].to_vec()];
    let diff = max_abs_diff(&keel_logprobs(&model, &seqs, 1.0), &reference_logprobs(&out, &seqs, 1.0, dir.path()));
    assert!(diff <= 1e-4, "{arch:?}: max |keel - transformers| = {diff:e}");
    let im_end = i64::from(tokenizer.token_to_id("<|im_end|>").unwrap());
    assert!(tokenizer.eos_token_ids().contains(&im_end));
}

#[test]
fn init_llama_loads_in_transformers() {
    check_init(Architecture::Llama);
}

#[test]
fn init_qwen2_loads_in_transformers() {
    check_init(Architecture::Qwen2);
}

#[test]
fn init_qwen3_loads_in_transformers() {
    check_init(Architecture::Qwen3);
}

#[test]
fn init_qwen3_moe_loads_in_transformers() {
    check_init(Architecture::Qwen3Moe);
}

#[test]
fn init_mixtral_loads_in_transformers() {
    check_init(Architecture::Mixtral);
}

/// Every family that is configuration of the one decoder, in its own chat format: transformers
/// renders each template as Keel does, tokenizes the same, and scores the same (all in one
/// Python process); the format's special tokens are single tokens and its end of turn ends
/// generation.
#[test]
fn init_of_every_family_in_its_chat_format_loads_in_transformers() {
    use keel_model::chat_format::ChatFormat;
    let families = [
        Architecture::Gemma2,
        Architecture::Gemma3,
        Architecture::Phi3,
        Architecture::Olmo2,
        Architecture::Olmo3,
        Architecture::Glm4,
        Architecture::Granite,
        Architecture::SmolLm3,
    ];
    let dir = tempfile::tempdir().unwrap();
    let mut jobs = Vec::new();
    let mut ours = Vec::new();
    for arch in families {
        let out = dir.path().join(arch.short_name());
        init(arch, &out);
        let tokenizer = Tokenizer::load(&out).unwrap();
        let format = ChatFormat::of(arch);
        for token in format.special {
            let ids = tokenizer.encode(token, false).unwrap();
            assert_eq!(ids.len(), 1, "{arch:?}: {token} is one token");
        }
        let end = i64::from(tokenizer.token_to_id(format.end_of_turn).unwrap());
        assert!(tokenizer.eos_token_ids().contains(&end), "{arch:?}: {} ends generation", format.end_of_turn);
        let rendered: Vec<String> =
            [false, true].map(|g| tokenizer.apply_chat_template(&conversation(), g).unwrap()).into();
        let ids: Vec<i64> = tokenizer.encode(&rendered[1], false).unwrap().into_iter().map(i64::from).collect();
        let sequences = vec![ids.clone(), ids[..7].to_vec()];
        let model = load_f32(&out);
        jobs.push(json!({"model": out, "messages": conversation(), "text": rendered[1], "sequences": sequences}));
        ours.push((arch, rendered, ids, keel_logprobs(&model, &sequences, 1.0)));
    }
    let jobs_file = dir.path().join("jobs.json");
    std::fs::write(&jobs_file, serde_json::to_string(&jobs).unwrap()).unwrap();
    let results = reference(&["inspect-many", jobs_file.to_str().unwrap()])["results"].clone();
    for ((arch, rendered, ids, logprobs), theirs) in ours.into_iter().zip(results.as_array().unwrap()) {
        let their_rendered: Vec<String> = serde_json::from_value(theirs["rendered"].clone()).unwrap();
        assert_eq!(rendered, their_rendered, "{arch:?}: the chat template renders differently");
        let their_ids: Vec<i64> = serde_json::from_value(theirs["ids"].clone()).unwrap();
        assert_eq!(ids, their_ids, "{arch:?}: tokenization differs");
        let their_logprobs: Vec<Vec<f64>> = serde_json::from_value(theirs["logprobs"].clone()).unwrap();
        let diff = max_abs_diff(&logprobs, &their_logprobs);
        assert!(diff <= 1e-4, "{arch:?}: max |keel - transformers| = {diff:e}");
    }
}

#[test]
fn init_refuses_a_non_empty_directory_and_missing_corpus() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("keep.txt"), "x").unwrap();
    let spec = InitSpec {
        architecture: Architecture::Llama,
        preset: Preset::Tiny,
        tokenizer_corpus: vec![corpus()],
        out: dir.path().into(),
        seed: 0,
    };
    assert!(init_model(&spec).unwrap_err().to_string().contains("not empty"));
    let spec = InitSpec { tokenizer_corpus: vec![dir.path().join("none.txt")], out: dir.path().join("m"), ..spec };
    assert!(init_model(&spec).unwrap_err().to_string().contains("none.txt"));
}

fn render_both(
    template: &str,
    messages: &Value,
    vars: &Value,
    add_generation_prompt: bool,
) -> (Result<String, String>, String) {
    let dir = tempfile::tempdir().unwrap();
    let (t, m, v) = (dir.path().join("t.jinja"), dir.path().join("m.json"), dir.path().join("v.json"));
    std::fs::write(&t, template).unwrap();
    std::fs::write(&m, messages.to_string()).unwrap();
    std::fs::write(&v, vars.to_string()).unwrap();
    let mut args = vec!["render-template", t.to_str().unwrap(), m.to_str().unwrap(), v.to_str().unwrap()];
    if add_generation_prompt {
        args.push("--add-generation-prompt");
    }
    let expected = reference(&args)["text"].as_str().unwrap().to_string();
    let ours = keel_model::chat::ChatTemplate::new(template)
        .and_then(|t| t.render(messages, add_generation_prompt, vars))
        .map_err(|e| e.to_string());
    (ours, expected)
}

#[test]
fn tool_template_renders_like_jinja2() {
    let template = std::fs::read_to_string(workspace_root().join("tests/reference/templates/tools.jinja")).unwrap();
    let vars = json!({
        "bos_token": "<s>", "eos_token": "</s>",
        "tools": [{"type": "function", "function": {"name": "add", "description": "Adds — exactly",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}],
    });
    let messages = json!([
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"function": {"name": "add", "arguments": {"a": 2, "b": 3.5}}},
            {"function": {"name": "add", "arguments": {"a": 1, "b": 1}}},
            {"function": {"name": "add", "arguments": {"a": 9, "b": 9}}}]},
        {"role": "tool", "content": [{"type": "text", "text": "5.5"}, {"type": "text", "text": "ok"}]},
        {"role": "user", "content": "skip this one"},
        {"role": "assistant", "content": "done"},
    ]);
    for add_generation_prompt in [false, true] {
        let (ours, expected) = render_both(&template, &messages, &vars, add_generation_prompt);
        assert_eq!(ours.unwrap(), expected);
    }
}

#[test]
fn raise_exception_in_template_is_an_error() {
    let template = std::fs::read_to_string(workspace_root().join("tests/reference/templates/tools.jinja")).unwrap();
    let messages = json!([{"role": "narrator", "content": "once upon a time"}]);
    let ours = keel_model::chat::ChatTemplate::new(&template).unwrap().render(
        &messages,
        false,
        &json!({"bos_token": "", "eos_token": ""}),
    );
    assert_eq!(
        ours.unwrap_err().to_string(),
        "chat template: Conversation roles must be user, assistant or tool, got narrator"
    );
}
