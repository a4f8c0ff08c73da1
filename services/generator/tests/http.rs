//! The generator served in-process on a tiny `keel model init` model, driven over HTTP:
//! greedy parity with `keel model generate` and transformers, seeded sampling independent of
//! the batch, logprobs that agree with the scorer, streaming, stop strings, chat, errors and
//! overload.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use keel_generator::{Config, default_config, load};
use keel_model::init::{InitSpec, Preset, init_model};
use keel_model::sampling::{SamplingParams, generate};
use keel_model::{Architecture, CausalLm};
use serde_json::{Value, json};
use tch::{Device, Kind, Tensor};

fn tiny_model(dir: &Path) -> PathBuf {
    let out = dir.join("tiny");
    init_model(&InitSpec {
        architecture: Architecture::Qwen3,
        preset: Preset::Tiny,
        tokenizer_corpus: vec![keel_testkit::workspace_root().join("examples/tokenizer-corpus.txt")],
        out: out.clone(),
        seed: 3,
    })
    .unwrap();
    out
}

struct Server {
    url: String,
    client: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

fn serve_config() -> Config {
    let mut config = default_config();
    config.max_num_seqs = 8;
    config.max_model_len = Some(256);
    config
}

async fn serve(model: &Path, tune: impl FnOnce(&mut Config)) -> Server {
    let mut config = serve_config();
    tune(&mut config);
    let state = load(&config, model, None).unwrap();
    let app = keel_generator::app(state, config.api_key.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(keel_service::serve(listener, app, async move {
        let _ = stopped.await;
    }));
    Server { url, client: reqwest::Client::new(), _stop: stop }
}

impl Server {
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let response = self.client.post(format!("{}{path}", self.url)).json(&body).send().await.unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }

    /// The JSON chunks of a streamed request (checking that `[DONE]` ends the stream).
    async fn stream(&self, path: &str, body: &Value) -> Vec<Value> {
        let response = self.client.post(format!("{}{path}", self.url)).json(body).send().await.unwrap();
        let data = sse_data(&response.text().await.unwrap());
        assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect()
    }

    async fn get(&self, path: &str) -> (u16, Value) {
        let response = self.client.get(format!("{}{path}", self.url)).send().await.unwrap();
        let status = response.status().as_u16();
        let text = response.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {status} {text:?}: {e}")))
    }

    async fn ok(&self, path: &str, body: Value) -> Value {
        let (status, body) = self.post(path, body).await;
        assert_eq!(status, 200, "{body}");
        body
    }
}

fn prompt_ids() -> Vec<i64> {
    vec![5, 88, 17, 201, 33, 9]
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_output_matches_keel_generate_and_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let body = server
        .ok(
            "/v1/completions",
            json!({"model": "tiny", "prompt": prompt_ids(), "max_tokens": 20, "temperature": 0,
            "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
    let ids: Vec<i64> = serde_json::from_value(body["choices"][0]["token_ids"].clone()).unwrap();
    assert_eq!(ids.len(), 20);
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert_eq!(body["usage"]["completion_tokens"], 20);

    let local = CausalLm::load(&model, Device::Cpu, Kind::Float).unwrap();
    let cli =
        generate(&local, &prompt_ids(), 20, &[], SamplingParams { temperature: 0.0, ..Default::default() }).unwrap();
    assert_eq!(ids, cli.tokens, "keel model generate");

    let ids_file = dir.path().join("ids.json");
    std::fs::write(&ids_file, json!(prompt_ids()).to_string()).unwrap();
    let reference = keel_testkit::reference(&[
        "generate",
        model.to_str().unwrap(),
        ids_file.to_str().unwrap(),
        "--max-new-tokens",
        "20",
    ]);
    let hf: Vec<i64> = serde_json::from_value(reference["token_ids"].clone()).unwrap();
    assert_eq!(ids, hf, "transformers generate");
}

/// The same requests, arriving together (several prompts, n = 3 sharing one prefill, a
/// refit-free run), served at tensor_parallel_size 1, 2 and 4 (the tiny model has 4 heads
/// and 2 KV heads: split at 2, replicated at 4): the greedy tokens are identical.
#[tokio::test(flavor = "multi_thread")]
async fn greedy_output_at_tensor_parallel_2_and_4_equals_tp_1() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let prompts: Vec<Vec<i64>> = vec![prompt_ids(), vec![7, 7, 300, 41], vec![120, 5, 64, 8, 9, 10, 411, 2, 3]];
    let mut outputs = Vec::new();
    for tp in [1, 2, 4] {
        let server = serve(&model, |c| c.tensor_parallel_size = tp).await;
        let requests = prompts.iter().map(|prompt| {
            server.ok(
                "/v1/completions",
                json!({"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0, "n": 3,
                "ignore_eos": true, "return_token_ids": true}),
            )
        });
        let bodies = futures::future::join_all(requests).await;
        let tokens: Vec<Vec<Vec<i64>>> = bodies
            .iter()
            .map(|body| {
                let choices = body["choices"].as_array().unwrap();
                assert_eq!(choices.len(), 3, "TP={tp}: {body}");
                choices.iter().map(|c| serde_json::from_value(c["token_ids"].clone()).unwrap()).collect()
            })
            .collect();
        for per_prompt in &tokens {
            assert!(per_prompt.iter().all(|t| t.len() == 24 && *t == per_prompt[0]), "TP={tp}: greedy samples agree");
        }
        // The ranks score a prompt together too (echo, as lm-eval asks).
        let echoed = server
            .ok(
                "/v1/completions",
                json!({"model": "tiny", "prompt": prompts[0], "max_tokens": 0, "echo": true,
                "logprobs": 2}),
            )
            .await;
        let scored: Vec<f64> = echoed["choices"][0]["logprobs"]["token_logprobs"].as_array().unwrap()[1..]
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        outputs.push((tp, tokens, scored));
    }
    for (tp, tokens, scored) in &outputs[1..] {
        assert_eq!(tokens, &outputs[0].1, "greedy output at TP={tp} differs from TP=1");
        let diff = scored.iter().zip(&outputs[0].2).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        assert!(scored.len() == outputs[0].2.len() && diff < 1e-5, "echoed logprobs at TP={tp}: {diff:e}");
    }
    let error = match load(&Config { tensor_parallel_size: 3, ..serve_config() }, &model, None) {
        Ok(_) => panic!("4 heads do not split over 3 ranks"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains("num_attention_heads"), "{error}");
}

/// A KV cache too small for one sequence of max_model_len, and limits that do not fit
/// together, stop the service at start-up with one line naming the setting.
#[test]
fn a_cache_too_small_and_inconsistent_limits_are_start_up_errors() {
    use keel_service::ServiceConfig;
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let tight = Config { kv_cache_memory_bytes: Some(64 * 1024), ..serve_config() };
    let error = match load(&tight, &model, None) {
        Ok(_) => panic!("64 KiB cannot hold a 256-token sequence"),
        Err(e) => e.to_string(),
    };
    assert!(error.contains("fewer than one sequence of max_model_len 256"), "{error}");
    let error = Config { max_num_batched_tokens: 4, ..serve_config() }.validate().unwrap_err().to_string();
    assert!(error.starts_with("max_num_batched_tokens:"), "{error}");
    let error = Config { gpu_memory_utilization: 1.5, ..serve_config() }.validate().unwrap_err().to_string();
    assert!(error.starts_with("gpu_memory_utilization:"), "{error}");
    // A group's settings that do not fit together name the one to change.
    let group = keel_collective::process::GroupConfig {
        name: "g".into(),
        rank: 0,
        size: 2,
        timeout_seconds: 30.0,
        address: None,
    };
    let grouped = |rank: usize, edit: fn(&mut Config)| {
        let mut config = Config {
            group: Some(keel_collective::process::GroupConfig { rank, ..group.clone() }),
            model: Some("/models/m".into()),
            ..serve_config()
        };
        edit(&mut config);
        config.validate().map_err(|e| e.to_string())
    };
    assert!(grouped(0, |_| {}).is_ok());
    assert!(grouped(1, |c| c.model = None).is_ok(), "a follower needs no model");
    assert_eq!(grouped(0, |c| c.tensor_parallel_size = 2).map(|()| 2), Ok(2));
    let error = grouped(0, |c| c.tensor_parallel_size = 4).unwrap_err();
    assert!(error.starts_with("tensor_parallel_size:") && error.contains("group.size (2)"), "{error}");
    assert!(grouped(0, |c| c.model = None).unwrap_err().starts_with("model:"));
    assert!(grouped(0, |c| c.nats_url.clear()).unwrap_err().starts_with("nats_url:"));
    assert!(grouped(2, |_| {}).unwrap_err().starts_with("group.rank:"));
}

/// Mean of exp(|generator logprob − scorer logprob|) over a sample's tokens.
fn logprob_error(model: &CausalLm, prompt: &[i64], tokens: &[i64], logprobs: &[f64], temperature: f64) -> f64 {
    let full: Vec<i64> = prompt.iter().chain(tokens).copied().collect();
    let ids = Tensor::from_slice(&full).unsqueeze(0);
    let scored = model.token_logprobs(&ids, &[full.len() as i64], temperature).unwrap();
    let scored = Vec::<f64>::try_from(scored.get(0).to_kind(Kind::Double)).unwrap();
    let tail = &scored[prompt.len()..];
    tail.iter().zip(logprobs).map(|(s, g)| (s - g).abs().exp()).sum::<f64>() / tokens.len() as f64
}

#[tokio::test(flavor = "multi_thread")]
async fn seeded_samples_do_not_depend_on_the_batch_and_logprobs_match_the_scorer() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let request = json!({"model": "tiny", "prompt": prompt_ids(), "max_tokens": 24, "temperature": 0.8, "top_p": 0.95,
        "seed": 1234, "n": 3, "ignore_eos": true, "return_token_ids": true, "logprobs": 0});
    let alone = server.ok("/v1/completions", request.clone()).await;

    // The same request again while other requests of different lengths arrive and leave.
    let others: Vec<_> = (0..6)
        .map(|i| {
            let body = json!({"model": "tiny", "prompt": [7 + i, 40, 41 + i], "max_tokens": 5 + 7 * i, "temperature": 1.0,
                "ignore_eos": true});
            let (client, url) = (server.client.clone(), server.url.clone());
            tokio::spawn(async move { client.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap().status() })
        })
        .collect();
    let busy = server.ok("/v1/completions", request).await;
    for other in others {
        assert_eq!(other.await.unwrap(), 200);
    }
    let samples = |body: &Value| -> Vec<Vec<i64>> {
        body["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| serde_json::from_value(c["token_ids"].clone()).unwrap())
            .collect()
    };
    assert_eq!(samples(&alone), samples(&busy));
    let distinct: std::collections::HashSet<_> = samples(&alone).into_iter().collect();
    assert_eq!(distinct.len(), 3, "the n samples differ");

    let local = CausalLm::load(&model, Device::Cpu, Kind::Float).unwrap();
    for choice in alone["choices"].as_array().unwrap() {
        let tokens: Vec<i64> = serde_json::from_value(choice["token_ids"].clone()).unwrap();
        let logprobs: Vec<f64> = serde_json::from_value(choice["logprobs"]["token_logprobs"].clone()).unwrap();
        let error = logprob_error(&local, &prompt_ids(), &tokens, &logprobs, 0.8);
        assert!(error <= 1.001, "mean exp|Δ| = {error}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_arriving_together_match_requests_run_one_by_one() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let requests: Vec<Value> = (0..6)
        .map(|i| {
            json!({"model": "tiny", "prompt": [3 + i, 50 + 2 * i, 9, 12 + i], "max_tokens": 6 + 4 * i,
            "temperature": if i % 2 == 0 { 0.0 } else { 0.9 }, "seed": i, "ignore_eos": true, "return_token_ids": true})
        })
        .collect();
    let mut one_by_one = Vec::new();
    for r in &requests {
        one_by_one.push(server.ok("/v1/completions", r.clone()).await["choices"][0]["token_ids"].clone());
    }
    let together: Vec<_> = requests
        .iter()
        .map(|r| {
            let (client, url, body) = (server.client.clone(), server.url.clone(), r.clone());
            tokio::spawn(async move {
                let body: Value = client
                    .post(format!("{url}/v1/completions"))
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                body["choices"][0]["token_ids"].clone()
            })
        })
        .collect();
    for (i, handle) in together.into_iter().enumerate() {
        assert_eq!(handle.await.unwrap(), one_by_one[i], "request {i}");
    }
}

/// The `data:` payloads of an SSE body.
fn sse_data(text: &str) -> Vec<String> {
    text.lines()
        .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
        .map(str::to_string)
        .collect()
}

/// `echo` returns the prompt before the completion, with its tokens' logprobs first (the
/// first null) — what lm-eval's loglikelihood requests send, `max_tokens` 0 included — and
/// vLLM's `prompt_logprobs` give each prompt token's logprob, rank and alternatives on
/// completions and chat. The prompt logprobs are transformers' (f32, temperature 1).
#[tokio::test(flavor = "multi_thread")]
async fn echo_and_prompt_logprobs_score_the_prompt_as_transformers_does() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let prompt = prompt_ids();
    let reference = keel_testkit::reference_logprobs(&model, std::slice::from_ref(&prompt), 1.0, dir.path());
    let close = |got: &Value, want: f64, what: &str| {
        let got = got.as_f64().unwrap_or_else(|| panic!("{what}: {got}"));
        assert!((got - want).abs() < 1e-4, "{what}: {got} vs transformers' {want}");
    };

    // lm-eval's loglikelihood request: a batch of token-id prompts, echo, no new tokens.
    let scored = server
        .ok(
            "/v1/completions",
            json!({"model": "tiny", "prompt": [prompt, prompt[..5]], "max_tokens": 0, "echo": true,
            "logprobs": 1, "temperature": 0}),
        )
        .await;
    let choices = scored["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2);
    let first = &choices[0]["logprobs"];
    assert_eq!(first["tokens"].as_array().unwrap().len(), prompt.len());
    assert!(first["token_logprobs"][0].is_null() && first["top_logprobs"][0].is_null(), "{first}");
    for i in 1..prompt.len() {
        close(&first["token_logprobs"][i], reference[0][i], &format!("echoed token {i}"));
        assert!(!first["top_logprobs"][i].as_object().unwrap().is_empty());
    }
    assert_eq!(choices[1]["logprobs"]["token_logprobs"].as_array().unwrap().len(), 5);
    assert_eq!(choices[0]["finish_reason"], "length");
    assert_eq!(scored["usage"]["completion_tokens"], 0);
    let text = server.ok("/detokenize", json!({"tokens": prompt})).await;
    assert_eq!(choices[0]["text"], text["prompt"]);

    // Echo with generation: the prompt then the very completion asked for without echo.
    let ask = json!({"model": "tiny", "prompt": "12 + 30 =", "max_tokens": 5, "seed": 3, "logprobs": 2,
        "ignore_eos": true});
    let plain = server.ok("/v1/completions", ask.clone()).await;
    let mut echo = ask.clone();
    echo["echo"] = json!(true);
    let echoed = server.ok("/v1/completions", echo).await;
    let (plain, echoed) = (&plain["choices"][0], &echoed["choices"][0]);
    assert_eq!(echoed["text"].as_str().unwrap(), format!("12 + 30 ={}", plain["text"].as_str().unwrap()));
    let generated = plain["logprobs"]["token_logprobs"].as_array().unwrap();
    let all = echoed["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(&all[all.len() - generated.len()..], generated.as_slice());
    assert!(all[0].is_null());

    // vLLM's prompt_logprobs: the prompt token itself with its rank, and the top 3.
    let vllm = server
        .ok("/v1/completions", json!({"model": "tiny", "prompt": prompt, "max_tokens": 1, "prompt_logprobs": 3}))
        .await;
    let entries = vllm["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(entries.len(), prompt.len());
    assert!(entries[0].is_null());
    for i in 1..prompt.len() {
        let entry = entries[i].as_object().unwrap();
        let own = &entry[&prompt[i].to_string()];
        close(&own["logprob"], reference[0][i], &format!("prompt_logprobs token {i}"));
        assert!(own["rank"].as_i64().unwrap() >= 1);
        let ranked: Vec<i64> = entry.values().map(|e| e["rank"].as_i64().unwrap()).filter(|r| *r <= 3).collect();
        assert!(ranked.len() >= 3 && (1..=3).all(|r| ranked.contains(&r)), "{entry:?}");
    }
    let chat = server
        .ok(
            "/v1/chat/completions",
            json!({"model": "tiny", "messages": [{"role": "user", "content": "Add 4 and 5."}],
            "max_tokens": 2, "prompt_logprobs": 1}),
        )
        .await;
    let chat_entries = chat["prompt_logprobs"].as_array().unwrap();
    assert!(chat_entries.len() > 3 && chat_entries[0].is_null() && chat_entries[1].is_object(), "{chat}");

    // Refused rather than ignored: echo or prompt_logprobs with stream.
    for field in ["echo", "prompt_logprobs"] {
        let mut body = json!({"model": "tiny", "prompt": "hi", "max_tokens": 2, "stream": true});
        body[field] = if field == "echo" { json!(true) } else { json!(1) };
        let (status, error) = server.post("/v1/completions", body).await;
        assert_eq!((status, error["error"]["param"].as_str()), (400, Some(field)), "{error}");
    }
    let (status, error) =
        server.post("/v1/completions", json!({"model": "tiny", "prompt": "hi", "max_tokens": 0})).await;
    assert_eq!((status, error["error"]["param"].as_str()), (400, Some("max_tokens")), "no echo, no tokens: {error}");
}

/// Structured output: whatever a random model would write, the output matches the regex,
/// is one of the choices, or parses under the JSON schema (llguidance masks every step's
/// logits), for every sample of n, streamed or not, on completions and chat; a schema that
/// does not compile and two kinds at once are 400s naming the field.
#[tokio::test(flavor = "multi_thread")]
async fn structured_output_always_parses() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let base =
        json!({"model": "tiny", "prompt": "Is 4 + 5 = 9?", "max_tokens": 64, "temperature": 1.0, "seed": 5, "n": 3});
    let texts = |body: &Value| -> Vec<String> {
        body["choices"].as_array().unwrap().iter().map(|c| c["text"].as_str().unwrap().to_string()).collect()
    };
    let ask = |field: &str, value: Value| {
        let mut body = base.clone();
        body[field] = value;
        body
    };

    let choices = server.ok("/v1/completions", ask("guided_choice", json!(["yes", "no", "maybe (a+b)"]))).await;
    for text in texts(&choices) {
        assert!(["yes", "no", "maybe (a+b)"].contains(&text.as_str()), "{text:?}");
    }
    let digits = server.ok("/v1/completions", ask("structured_outputs", json!({"regex": "[0-9]{2,3}-[a-c]"}))).await;
    for text in texts(&digits) {
        let (number, letter) = text.split_once('-').unwrap_or_else(|| panic!("{text:?}"));
        assert!((2..=3).contains(&number.len()) && number.chars().all(|c| c.is_ascii_digit()), "{text:?}");
        assert!(["a", "b", "c"].contains(&letter), "{text:?}");
    }
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["ok", "color", "size"],
        "additionalProperties": false});
    let format = json!({"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}});
    let mut chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 96, "temperature": 1.0, "seed": 2, "n": 2, "response_format": format});
    for (path, body) in
        [("/v1/completions", ask("guided_json", schema.clone())), ("/v1/chat/completions", chat.clone())]
    {
        let answer = server.ok(path, body.clone()).await;
        for choice in answer["choices"].as_array().unwrap() {
            let text = choice["text"].as_str().or(choice["message"]["content"].as_str()).unwrap();
            let value: Value =
                serde_json::from_str(text).unwrap_or_else(|e| panic!("{path}: {text:?} is not JSON: {e}"));
            assert!(
                value["ok"].is_boolean() && ["red", "green"].contains(&value["color"].as_str().unwrap()),
                "{value}"
            );
            assert!(value["size"].as_i64().is_some_and(|s| (0..=99).contains(&s)), "{value}");
            assert_eq!(value.as_object().unwrap().len(), 3, "{value}");
        }
    }
    // More shapes: arrays with bounds, nested objects, string patterns and lengths, unions.
    let schemas = [
        json!({"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}),
        json!({"type": "object", "properties": {"point": {"type": "object", "properties": {"x": {"type": "integer",
            "minimum": -5, "maximum": 5}, "label": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
            "required": ["x", "label"], "additionalProperties": false}}, "required": ["point"],
            "additionalProperties": false}),
        json!({"anyOf": [{"type": "boolean"}, {"type": "null"}, {"enum": [1, 2, 3]}]}),
        json!({"type": "string", "maxLength": 6}),
    ];
    for schema in &schemas {
        let answer = server.ok("/v1/completions", ask("guided_json", schema.clone())).await;
        for text in texts(&answer) {
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{schema}: {text:?}: {e}"));
            let fits = match schema.get("type").and_then(Value::as_str) {
                Some("array") => value.as_array().is_some_and(|a| {
                    (1..=3).contains(&a.len()) && a.iter().all(|v| ["a", "b", "c"].contains(&v.as_str().unwrap_or("")))
                }),
                Some("object") => {
                    let x = value["point"]["x"].as_i64();
                    let label = value["point"]["label"].as_str().unwrap_or("");
                    x.is_some_and(|x| (-5..=5).contains(&x))
                        && (1..=4).contains(&label.len())
                        && label.chars().all(|c| c.is_ascii_lowercase())
                }
                Some("string") => value.as_str().is_some_and(|s| s.chars().count() <= 6),
                _ => value.is_boolean() || value.is_null() || [1, 2, 3].contains(&value.as_i64().unwrap_or(0)),
            };
            assert!(fits, "{text:?} does not fit {schema}");
        }
    }

    // Streamed: the pieces make JSON under the schema too.
    chat["stream"] = json!(true);
    chat["n"] = json!(1);
    let mut text = String::new();
    for chunk in server.stream("/v1/chat/completions", &chat).await {
        text.push_str(chunk["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("streamed {text:?}: {e}"));
    assert!(value["ok"].is_boolean(), "{value}");

    let (status, error) = server.post("/v1/completions", ask("guided_regex", json!("[0-9"))).await;
    assert_eq!((status, error["error"]["param"].as_str()), (400, Some("guided_regex")), "{error}");
    let mut both = ask("guided_regex", json!("[0-9]+"));
    both["guided_choice"] = json!(["a"]);
    let (status, error) = server.post("/v1/completions", both).await;
    assert_eq!(status, 400, "{error}");
}

/// `logit_bias` moves sampling as OpenAI's does: +100 on a token makes it every token drawn,
/// -100 on the greedy choice makes greedy pick another; ids outside the vocabulary and biases
/// outside -100..100 are 400s naming the field.
#[tokio::test(flavor = "multi_thread")]
async fn logit_bias_moves_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let ids = |body: &Value| -> Vec<i64> { serde_json::from_value(body["choices"][0]["token_ids"].clone()).unwrap() };
    let ask = json!({"model": "tiny", "prompt": prompt_ids(), "max_tokens": 6, "temperature": 1.0, "seed": 4,
        "ignore_eos": true, "return_token_ids": true});
    let mut forced = ask.clone();
    forced["logit_bias"] = json!({"42": 100});
    assert_eq!(ids(&server.ok("/v1/completions", forced).await), vec![42; 6]);
    let mut greedy = ask.clone();
    greedy["temperature"] = json!(0);
    let first = ids(&server.ok("/v1/completions", greedy.clone()).await)[0];
    greedy["logit_bias"] = json!({ first.to_string(): -100 });
    assert_ne!(ids(&server.ok("/v1/completions", greedy).await)[0], first, "-100 bans the greedy token");
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "logit_bias": {"7": 100}, "return_token_ids": true});
    assert_eq!(ids(&server.ok("/v1/chat/completions", chat).await), vec![7; 3]);
    for bad in [json!({"100000": 1}), json!({"x": 1}), json!({"5": -101})] {
        let mut body = ask.clone();
        body["logit_bias"] = bad;
        let (status, error) = server.post("/v1/completions", body).await;
        assert_eq!((status, error["error"]["param"].as_str()), (400, Some("logit_bias")), "{error}");
    }
}

/// No field is ignored in silence: OpenAI's and vLLM's fields that are not served are 400s
/// naming the field unless neutral, content given as text parts (or null) renders as text,
/// and `chat_template_kwargs` reach the template.
#[tokio::test(flavor = "multi_thread")]
async fn fields_not_served_are_refused_by_name_and_chat_content_takes_every_form() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    // A template that reads a variable, as Qwen3's reads enable_thinking.
    let config_path = model.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    let template = config["chat_template"].as_str().unwrap().to_string()
        + "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}";
    config["chat_template"] = json!(template);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let server = serve(&model, |_| {}).await;

    for (field, value) in [
        ("tools", json!([{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])),
        ("tool_choice", json!("required")),
        ("response_format", json!({"type": "xml"})),
        ("logit_bias", json!({"5": 101})),
        ("best_of", json!(3)),
        ("repetition_penalty", json!(1.3)),
        ("use_beam_search", json!(true)),
        ("echo", json!(true)),
    ] {
        let mut body = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        body[field] = value;
        let (status, error) = server.post("/v1/chat/completions", body).await;
        assert_eq!((status, error["error"]["param"].as_str()), (400, Some(field)), "{error}");
    }
    let (status, error) = server
        .post("/v1/completions", json!({"model": "tiny", "prompt": "hi", "max_tokens": 2, "suffix": "end"}))
        .await;
    assert_eq!((status, error["error"]["param"].as_str()), (400, Some("suffix")), "{error}");
    // Neutral values and fields that change nothing pass.
    server
        .ok(
            "/v1/completions",
            json!({"model": "tiny", "prompt": "hi", "max_tokens": 2, "suffix": null, "logit_bias": {},
            "tools": [], "best_of": 1, "user": "someone", "repetition_penalty": 1.0, "not_an_api_field": 3}),
        )
        .await;

    let prompt_ids = |body: Value| async {
        let mut body = body;
        body["model"] = json!("tiny");
        body["max_tokens"] = json!(1);
        body["return_token_ids"] = json!(true);
        let answer = server.ok("/v1/chat/completions", body).await;
        serde_json::from_value::<Vec<i64>>(answer["prompt_token_ids"].clone()).unwrap()
    };
    let plain = prompt_ids(json!({"messages": [{"role": "user", "content": "Add 4 and 5."}]})).await;
    let parts = prompt_ids(json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Add 4"},
        {"type": "text", "text": " and 5."}]}]}))
    .await;
    assert_eq!(parts, plain, "text parts render as their text");
    prompt_ids(json!({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": null},
        {"role": "user", "content": "again"}]}))
    .await;
    let (status, error) = server
        .post(
            "/v1/chat/completions",
            json!({"model": "tiny", "max_tokens": 1, "messages": [{"role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}),
        )
        .await;
    assert_eq!((status, error["error"]["param"].as_str()), (400, Some("messages")), "{error}");
    let thinking_off = prompt_ids(json!({"messages": [{"role": "user", "content": "Add 4 and 5."}],
        "chat_template_kwargs": {"enable_thinking": false}}))
    .await;
    assert!(
        thinking_off.len() > plain.len() && thinking_off[..plain.len()] == plain[..],
        "the kwargs reach the template"
    );
    // /tokenize renders messages as a chat request does, kwargs and text parts included.
    let tokenized = server
        .ok(
            "/tokenize",
            json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "Add 4 and 5."}]}],
            "chat_template_kwargs": {"enable_thinking": false}}),
        )
        .await;
    assert_eq!(serde_json::from_value::<Vec<i64>>(tokenized["tokens"].clone()).unwrap(), thinking_off);
}

/// A list of prompts (texts or token-id lists, as lm-eval batches them) is served as that many
/// independent requests: prompt p's sample i is choice p·n + i and equals sample i of the
/// prompt sent alone, streamed or not; usage adds up; an empty list and more prompts than the
/// server holds are 400s naming `prompt`.
#[tokio::test(flavor = "multi_thread")]
async fn a_list_of_prompts_is_served_as_independent_requests() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let ids = prompt_ids();
    let base = json!({"model": "tiny", "max_tokens": 6, "temperature": 0.9, "seed": 7, "n": 2, "ignore_eos": true,
        "return_token_ids": true});
    let with = |prompt: Value| {
        let mut body = base.clone();
        body["prompt"] = prompt;
        body
    };
    let texts = json!(["12 + 30 =", "7 - 2 ="]);
    let lists = json!([ids[..3], ids, ids[1..4]]);
    for prompts in [texts, lists] {
        let alone: Vec<Value> = futures::future::join_all(
            prompts.as_array().unwrap().iter().map(|p| server.ok("/v1/completions", with(p.clone()))),
        )
        .await;
        let together = server.ok("/v1/completions", with(prompts.clone())).await;
        let choices = together["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2 * alone.len());
        for (p, single) in alone.iter().enumerate() {
            for i in 0..2 {
                let choice = &choices[p * 2 + i];
                assert_eq!(choice["index"], p * 2 + i);
                assert_eq!(choice["token_ids"], single["choices"][i]["token_ids"], "prompt {p} sample {i}");
                assert_eq!(choice["text"], single["choices"][i]["text"]);
                assert_eq!(choice["prompt_token_ids"], single["choices"][i]["prompt_token_ids"]);
            }
        }
        let sum = |field: &str| alone.iter().map(|b| b["usage"][field].as_u64().unwrap()).sum::<u64>();
        assert_eq!(together["usage"]["prompt_tokens"], sum("prompt_tokens"));
        assert_eq!(together["usage"]["completion_tokens"], sum("completion_tokens"));

        // Streamed: each choice's pieces in order make its whole text, and each ends once.
        let mut streamed = with(prompts.clone());
        streamed["stream"] = json!(true);
        let mut texts = vec![String::new(); choices.len()];
        let mut finished = vec![0; choices.len()];
        for chunk in server.stream("/v1/completions", &streamed).await {
            for choice in chunk["choices"].as_array().unwrap() {
                let index = choice["index"].as_u64().unwrap() as usize;
                texts[index].push_str(choice["text"].as_str().unwrap());
                finished[index] += usize::from(!choice["finish_reason"].is_null());
            }
        }
        for (index, choice) in choices.iter().enumerate() {
            assert_eq!(texts[index], choice["text"].as_str().unwrap(), "streamed choice {index}");
        }
        assert!(finished.iter().all(|f| *f == 1), "{finished:?}");
    }

    let (status, body) = server.post("/v1/completions", with(json!([]))).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("prompt")), "{body}");
    let many: Vec<Vec<i64>> = vec![ids.clone(); 200];
    let (status, body) = server.post("/v1/completions", with(json!(many))).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("prompt")), "{body}");
    assert!(body["error"]["message"].as_str().unwrap().contains("more than this server holds"), "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_chat_stops_and_the_openai_surface() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;

    // Streaming equals non-streaming for the same seed, ends with [DONE], reports usage.
    let request = json!({"model": "tiny", "prompt": "What is 2 + 3?", "max_tokens": 16, "temperature": 0.7, "seed": 5,
        "ignore_eos": true});
    let whole = server.ok("/v1/completions", request.clone()).await;
    let mut streamed = request.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let chunks = server.stream("/v1/completions", &streamed).await;
    let joined: String = chunks.iter().filter_map(|c| c["choices"].get(0).and_then(|ch| ch["text"].as_str())).collect();
    assert_eq!(joined, whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 16);

    // A stop string ends the text before it (or keeps it, by flag).
    let full = whole["choices"][0]["text"].as_str().unwrap().to_string();
    // The first 3 characters past the fourth that are not all whitespace.
    let chars: Vec<char> = full.chars().collect();
    let cut: String = (4..chars.len().saturating_sub(3))
        .map(|i| chars[i..i + 3].iter().collect::<String>())
        .find(|c| !c.trim().is_empty())
        .expect("the 16-token completion has a stop candidate");
    let mut stopped = request.clone();
    stopped["stop"] = json!([cut]);
    let body = server.ok("/v1/completions", stopped.clone()).await;
    let expected = &full[..full.find(&cut).unwrap()];
    assert_eq!(body["choices"][0]["text"], expected);
    assert_eq!(
        (body["choices"][0]["finish_reason"].as_str(), body["choices"][0]["stop_reason"].as_str()),
        (Some("stop"), Some(cut.as_str()))
    );
    stopped["include_stop_str_in_output"] = json!(true);
    let body = server.ok("/v1/completions", stopped).await;
    assert_eq!(body["choices"][0]["text"].as_str().unwrap(), format!("{expected}{cut}"));

    // Chat through the model's template, with logprobs, n = 2, streamed too.
    let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "Add 4 and 5."}], "max_tokens": 8,
        "temperature": 0.9, "seed": 2, "n": 2, "logprobs": true, "top_logprobs": 3});
    let body = server.ok("/v1/chat/completions", chat.clone()).await;
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"].as_array().unwrap().len(), 2);
    let first = &body["choices"][0]["logprobs"]["content"][0];
    assert_eq!(first["top_logprobs"].as_array().unwrap().len(), 3);
    let mut streamed_chat = chat.clone();
    streamed_chat["stream"] = json!(true);
    let mut contents = [String::new(), String::new()];
    for chunk in server.stream("/v1/chat/completions", &streamed_chat).await {
        assert_eq!(chunk["object"], "chat.completion.chunk");
        for choice in chunk["choices"].as_array().unwrap() {
            if let Some(piece) = choice["delta"]["content"].as_str() {
                contents[choice["index"].as_u64().unwrap() as usize].push_str(piece);
            }
        }
    }
    for (i, content) in contents.iter().enumerate() {
        assert_eq!(content, body["choices"][i]["message"]["content"].as_str().unwrap());
    }

    // Models, tokenize and detokenize round trip, metrics.
    let models: Value =
        server.client.get(format!("{}/v1/models", server.url)).send().await.unwrap().json().await.unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    let tokens = server.ok("/tokenize", json!({"prompt": "12 + 30"})).await;
    let back = server.ok("/detokenize", json!({"tokens": tokens["tokens"]})).await;
    assert_eq!(back["prompt"], "12 + 30");
    let (status, card) = server.get("/v1/models/tiny").await;
    assert_eq!((status, &card["id"], &card["object"]), (200, &json!("tiny"), &json!("model")));
    let (status, error) = server.get("/v1/models/other").await;
    assert_eq!((status, &error["error"]["code"]), (404, &json!("model_not_found")), "{error}");
    let health = server.client.get(format!("{}/health", server.url)).send().await.unwrap();
    assert_eq!(health.status(), 200, "vLLM's health route");
    let (status, info) = server.get("/tokenizer_info").await;
    assert_eq!(status, 200);
    assert_eq!(info["model_max_length"], 256, "{info}");
    assert!(info["tokenizer_class"].is_string() && info["chat_template"].is_string(), "{info}");
    assert_eq!(info["eos_token"], "<|im_end|>", "{info}");

    // Metrics, labelled with the model's name: every request so far finished, and each is
    // in the end-to-end histogram and among the finished requests by reason.
    let metrics = server.client.get(format!("{}/metrics", server.url)).send().await.unwrap().text().await.unwrap();
    let value = |series: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '));
        line.unwrap_or_else(|| panic!("no `{series}` in:\n{metrics}")).rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value(r#"keel_generator_queue_depth{model_name="tiny"}"#), 0.0);
    assert!(value(r#"keel_generator_generated_tokens_total{model_name="tiny"}"#) > 0.0);
    let requests = value(r#"keel_generator_e2e_request_latency_seconds_count{model_name="tiny"}"#);
    let stopped = value(r#"keel_generator_requests_finished_total{model_name="tiny",finished_reason="stop"}"#);
    let cut = value(r#"keel_generator_requests_finished_total{model_name="tiny",finished_reason="length"}"#);
    assert!(stopped >= 1.0 && cut >= 1.0 && stopped + cut == requests, "{metrics}");
    assert_eq!(value(r#"keel_generator_time_to_first_token_seconds_count{model_name="tiny"}"#), requests);
    for histogram in ["time_per_output_token", "inter_token_latency"] {
        let series = format!(r#"keel_generator_{histogram}_seconds_bucket{{model_name="tiny",le="+Inf"}}"#);
        assert!(value(&series) > 0.0, "{series}");
    }
}

/// For stop strings that end inside a token, span tokens or start the text, with the stop
/// string cut or kept, the streamed text equals the whole response's and every streamed
/// choice ends with the whole response's finish reason.
#[tokio::test(flavor = "multi_thread")]
async fn streamed_and_whole_responses_agree_for_every_stop_string() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let base = json!({"model": "tiny", "prompt": "What is 12 + 30?", "max_tokens": 12, "temperature": 1.0,
        "seed": 3, "ignore_eos": true});
    let full = server.ok("/v1/completions", base.clone()).await["choices"][0]["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    let mut stops: Vec<String> = Vec::new();
    for start in 0..chars.len() {
        for len in [1, 2, 3, 5] {
            let candidate: String = chars[start..(start + len).min(chars.len())].iter().collect();
            if !candidate.trim().is_empty() && !stops.contains(&candidate) {
                stops.push(candidate);
            }
        }
    }
    assert!(stops.len() >= 10, "the completion {full:?} gives few stop strings");
    for (i, stop) in stops.iter().enumerate() {
        let mut request = base.clone();
        request["stop"] = json!([stop]);
        request["include_stop_str_in_output"] = json!(i % 2 == 1);
        let whole = server.ok("/v1/completions", request.clone()).await;
        request["stream"] = json!(true);
        let chunks = server.stream("/v1/completions", &request).await;
        let choices: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).collect();
        let joined: String = choices.iter().filter_map(|c| c["text"].as_str()).collect();
        assert_eq!(joined, whole["choices"][0]["text"].as_str().unwrap(), "stop {stop:?}");
        let finishes: Vec<&Value> = choices.iter().map(|c| &c["finish_reason"]).filter(|f| !f.is_null()).collect();
        assert_eq!(finishes, [&whole["choices"][0]["finish_reason"]], "stop {stop:?}: one finish reason, the whole's");
    }
}

/// `min_tokens` masks stop tokens until that many tokens are out.
#[tokio::test(flavor = "multi_thread")]
async fn min_tokens_hold_stop_tokens_back() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |_| {}).await;
    let base = json!({"model": "tiny", "prompt": prompt_ids(), "max_tokens": 10, "temperature": 0, "ignore_eos": true,
        "return_token_ids": true});
    let free = server.ok("/v1/completions", base.clone()).await;
    let tokens: Vec<i64> = serde_json::from_value(free["choices"][0]["token_ids"].clone()).unwrap();
    let stop = tokens[1];
    let mut request = base.clone();
    request["stop_token_ids"] = json!([stop]);
    let stopped = server.ok("/v1/completions", request.clone()).await;
    let first = tokens.iter().position(|&t| t == stop).unwrap() + 1;
    assert_eq!(stopped["choices"][0]["token_ids"].as_array().unwrap().len(), first);
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    request["min_tokens"] = json!(6);
    let held = server.ok("/v1/completions", request.clone()).await;
    let held_tokens: Vec<i64> = serde_json::from_value(held["choices"][0]["token_ids"].clone()).unwrap();
    assert!(held_tokens.len() >= 6, "{held_tokens:?}");
    assert!(!held_tokens[..6].contains(&stop), "no stop token among the first 6: {held_tokens:?}");
    request["min_tokens"] = json!(11);
    let (status, body) = server.post("/v1/completions", request).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("min_tokens")));
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_requests_get_openai_errors_and_overload_gets_429() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |c| {
        c.max_num_seqs = 1;
        c.max_waiting = 1;
    })
    .await;
    let (status, body) = server.post("/v1/completions", json!({"model": "tiny", "prompt": vec![5; 300]})).await;
    assert_eq!(status, 400);
    assert!(body["error"]["message"].as_str().unwrap().contains("maximum context length is 256"), "{body}");
    let (status, body) = server.post("/v1/completions", json!({"model": "other", "prompt": "hi"})).await;
    assert_eq!((status, body["error"]["code"].as_str()), (404, Some("model_not_found")));
    let (status, body) =
        server.post("/v1/completions", json!({"model": "tiny", "prompt": "hi", "temperature": -1})).await;
    assert_eq!((status, body["error"]["param"].as_str()), (400, Some("temperature")));
    let (status, _) = server.post("/v1/completions", json!({"model": "tiny", "prompt": "hi", "n": 2})).await;
    assert_eq!(status, 400, "n beyond the slots can never fit");
    let response = server
        .client
        .post(format!("{}/v1/completions", server.url))
        .body("{not json")
        .header("content-type", "application/json")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 400);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "invalid_request_error");

    // One running and one waiting fill the server: of a burst of eight long requests, those
    // that find it full are turned away with a retry hint, the others complete.
    let long = json!({"model": "tiny", "prompt": [5, 6], "max_tokens": 250, "ignore_eos": true, "temperature": 0});
    let burst: Vec<_> = (0..8)
        .map(|_| {
            let (client, url, body) = (server.client.clone(), server.url.clone(), long.clone());
            tokio::spawn(async move {
                let response = client.post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
                let retry = response.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
                (response.status().as_u16(), retry)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for handle in burst {
        outcomes.push(handle.await.unwrap());
    }
    assert!(outcomes.iter().all(|o| o.0 == 200 || *o == (429, Some("1".to_string()))), "{outcomes:?}");
    assert!(outcomes.iter().filter(|o| o.0 == 429).count() >= 1, "{outcomes:?}");
    assert!(outcomes.iter().filter(|o| o.0 == 200).count() >= 2, "{outcomes:?}");
    let health = server.client.get(format!("{}/healthz", server.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
}

/// With an API key (vLLM's `--api-key`), the OpenAI API answers only requests that carry it
/// (401 naming what to send); `/healthz` stays open.
#[tokio::test(flavor = "multi_thread")]
async fn an_api_key_guards_the_openai_api() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let server = serve(&model, |c| c.api_key = Some("sk-keel".into())).await;
    let body = json!({"model": "tiny", "prompt": prompt_ids(), "max_tokens": 2, "temperature": 0.0});
    let (status, refused) = server.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 401, "{refused}");
    assert!(refused["error"]["message"].as_str().unwrap().contains("Bearer"), "{refused}");
    let models = server.client.get(format!("{}/v1/models", server.url)).bearer_auth("wrong").send().await.unwrap();
    assert_eq!(models.status(), 401);
    let answered = server
        .client
        .post(format!("{}/v1/completions", server.url))
        .bearer_auth("sk-keel")
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(answered.status(), 200);
    let health = server.client.get(format!("{}/healthz", server.url)).send().await.unwrap();
    assert_eq!(health.status(), 200);
}
