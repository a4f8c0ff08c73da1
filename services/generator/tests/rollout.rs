//! A generator claimed by a run over the real NATS: it loads the run's model, then serves
//! the run's rollouts (queue group `generator` on the run's subject): token ids in, token
//! ids, logprobs and finish reasons out, stamped with the weight version; a weights-updated
//! event refits the generator, and weights that do not fit are refused while serving goes
//! on.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use keel_generator::{Serving as Http, claims, default_config};
use keel_model::init::{InitSpec, Preset, init_model};
use keel_model::sampling::{SamplingParams, generate};
use keel_model::{Architecture, CausalLm};
use keel_protocol::Subjects;
use serde_json::{Value, json};
use tch::{Device, Kind};

fn model(dir: &Path, name: &str, preset: Preset, seed: i64) -> PathBuf {
    let out = dir.join(name);
    init_model(&InitSpec {
        architecture: Architecture::Qwen3,
        preset,
        tokenizer_corpus: vec![keel_testkit::workspace_root().join("examples/tokenizer-corpus.txt")],
        out: out.clone(),
        seed,
    })
    .unwrap();
    out
}

fn greedy(dir: &Path, prompt: &[i64], tokens: usize) -> Vec<i64> {
    let local = CausalLm::load(dir, Device::Cpu, Kind::Float).unwrap();
    generate(&local, prompt, tokens, &[], SamplingParams { temperature: 0.0, ..Default::default() }).unwrap().tokens
}

/// A generator with no start-up model over the real NATS, on subjects of its own, claimed
/// by run `r1` and serving `dir` as its model.
struct Serving {
    client: async_nats::Client,
    subjects: Subjects,
    http: Http,
    /// The OpenAI API (key `secret`), served from `http`.
    url: String,
    stop: tokio::sync::oneshot::Sender<()>,
    server: tokio::task::JoinHandle<keel_generator::Result<()>>,
}

/// A request on one of the generator's own subjects, its `{"ok"}` or `{"error"}` reply.
async fn call(client: &async_nats::Client, subject: String, body: Value) -> Value {
    let reply = client.request(subject, body.to_string().into()).await.unwrap();
    serde_json::from_slice(&reply.payload).unwrap()
}

impl Serving {
    async fn start(dir: &Path, max_model_len: i64) -> Self {
        let mut config = default_config();
        config.max_num_seqs = 4;
        config.max_model_len = Some(max_model_len);
        config.generator_id = Some("g1".into());
        let client = keel_service::nats::connect(&keel_service::nats::default_url()).await.unwrap();
        let subjects = Subjects::new(&format!("keeltest.gen{}", uuid::Uuid::new_v4().simple())).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        // Loads and refits may read the directory the test's models are in.
        let roots = keel_service::paths::PathRoots::new(&[dir.parent().unwrap().to_path_buf()], "path_roots").unwrap();
        let http = Http::default();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        http.set_base_url(&url);
        tokio::spawn(keel_service::serve(
            listener,
            keel_generator::serving_app(http.clone(), Some("secret".into())),
            std::future::pending(),
        ));
        let generator =
            claims::Generator::new(client.clone(), subjects.clone(), &config, roots, http.clone(), None, None);
        let server = tokio::spawn(generator.serve(async move {
            let _ = stopped.await;
        }));
        let serving = Self { client, subjects, http, url, stop, server };
        serving.claim_and_load(dir).await;
        serving
    }

    /// Claims the generator for run `r1` (through the claim group, once it has joined it)
    /// and has it load `dir`.
    async fn claim_and_load(&self, dir: &Path) {
        use keel_protocol::subjects::GeneratorOp;
        let deadline = Instant::now() + Duration::from_secs(20);
        let claim = json!({"run_id": "r1", "lease_seconds": 60.0, "holder": "h1"});
        loop {
            match self.client.request(self.subjects.generator_claim(), claim.to_string().into()).await {
                Ok(reply) => {
                    let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
                    assert_eq!(reply["ok"]["worker_id"], "g1", "{reply}");
                    break;
                }
                Err(e) => assert!(Instant::now() < deadline, "no generator took the claim: {e}"),
            }
        }
        let other = json!({"run_id": "r2", "lease_seconds": 60.0});
        let busy = call(&self.client, self.subjects.generator("g1", GeneratorOp::Claim), other).await;
        assert_eq!(busy["error"]["type"], "busy", "{busy}");
        let load = json!({"run_id": "r1", "path": dir, "version": 0});
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(keel_protocol::lease::HOLDER_HEADER, "h1");
        let subject = self.subjects.generator("g1", GeneratorOp::Load);
        let reply = self.client.request_with_headers(subject, headers, load.to_string().into()).await.unwrap();
        let loaded: Value = serde_json::from_slice(&reply.payload).unwrap();
        assert_eq!(loaded["ok"]["served_model_name"], "r1", "{loaded}");
        let stale =
            call(&self.client, self.subjects.generator("g1", GeneratorOp::Heartbeat), json!({"run_id": "r1"})).await;
        assert_eq!(stale["error"]["type"], "stale_holder", "a request for no holder is refused: {stale}");
    }

    /// The weight version the generator's OpenAI API serves (its `/metrics`).
    fn stats(&self) -> std::sync::Arc<keel_generation::engine::Stats> {
        self.http.stats().unwrap()
    }

    /// Asks `body` until `done(reply)` (a refit has taken effect, or been refused), for up
    /// to 30 s.
    async fn ask_until(&self, body: &Value, what: &str, done: impl Fn(&Value) -> bool) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let reply = self.ask(body.clone()).await;
            if done(&reply) {
                return reply;
            }
            assert!(Instant::now() < deadline, "{what}: {reply}");
        }
    }

    /// A rollout's reply, retried until the generator has subscribed (or, on a machine busy
    /// with other tests, until a request outlasting NATS's request timeout gets its answer),
    /// for up to 60 s.
    async fn ask(&self, body: Value) -> Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.client.request(self.subjects.generate("r1"), body.to_string().into()).await {
                Ok(reply) => return serde_json::from_slice::<Value>(&reply.payload).unwrap(),
                Err(e) => assert!(Instant::now() < deadline, "no generator answered: {e}"),
            }
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.server.await.unwrap().unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rollouts_carry_the_weight_version_and_refits_swap_weights() {
    let dir = tempfile::tempdir().unwrap();
    let first = model(dir.path(), "first", Preset::Tiny, 1);
    let second = model(dir.path(), "second", Preset::Tiny, 2);
    let bigger = model(dir.path(), "bigger", Preset::Small, 3);
    let serving = Serving::start(&first, 128).await;
    let (client, subjects, stats) = (serving.client.clone(), serving.subjects.clone(), serving.stats());
    let ask = |body: Value| serving.ask(body);
    let prompt = vec![5i64, 88, 17, 201, 33];
    let request = json!({"run_id": "r1", "prompt_token_ids": prompt, "n": 2, "max_tokens": 12,
        "sampling": {"temperature": 0.0}, "ignore_eos": true});
    let reply = ask(request.clone()).await;
    let ok = &reply["ok"];
    assert_eq!(ok["weight_version"], 0, "{reply}");
    for sample in ok["samples"].as_array().unwrap() {
        let ids: Vec<i64> = serde_json::from_value(sample["token_ids"].clone()).unwrap();
        assert_eq!(ids, greedy(&first, &prompt, 12));
        assert_eq!(sample["logprobs"].as_array().unwrap().len(), 12);
        assert_eq!(sample["finish_reason"], "length");
    }

    let mut needs_newer = request.clone();
    needs_newer["min_weight_version"] = json!(1);
    assert_eq!(ask(needs_newer.clone()).await["error"]["type"], "stale_weights");
    let reply = ask(json!({"run_id": "r1", "prompt_token_ids": [], "max_tokens": 3})).await;
    assert_eq!(reply["error"]["type"], "invalid_request");
    assert!(reply["error"]["message"].as_str().unwrap().contains("prompt"), "{reply}");
    let reply = client.request(subjects.generate("r1"), "{oops".into()).await.unwrap();
    let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(reply["error"]["type"], "invalid_request");

    // New weights: once refitted, replies carry version 1 and come from the new model.
    let update = json!({"run_id": "r1", "version": 1, "path": second});
    client.publish(subjects.weights_updated("r1"), update.to_string().into()).await.unwrap();
    let refitted = serving
        .ask_until(&needs_newer, "never refitted", |reply| {
            let served = reply.get("ok").is_some();
            assert!(served || reply["error"]["type"] == "stale_weights", "{reply}");
            served
        })
        .await;
    assert_eq!(refitted["ok"]["weight_version"], 1);
    let ids: Vec<i64> = serde_json::from_value(refitted["ok"]["samples"][0]["token_ids"].clone()).unwrap();
    assert_eq!(ids, greedy(&second, &prompt, 12));
    let refits = |s: &keel_generation::engine::Stats| s.refits.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(refits(&stats), 1);
    assert!(stats.last_refit_micros.load(std::sync::atomic::Ordering::Relaxed) > 0, "the refit time is exported");

    // Weights of another shape are refused; the generator keeps serving version 1.
    let update = json!({"run_id": "r1", "version": 2, "path": bigger});
    client.publish(subjects.weights_updated("r1"), update.to_string().into()).await.unwrap();
    client.flush().await.unwrap();
    for _ in 0..3 {
        let reply = ask(needs_newer.clone()).await;
        assert_eq!(reply["ok"]["weight_version"], 1, "{reply}");
    }
    assert_eq!(refits(&stats), 1, "a refused refit is not counted");
    // A rollout that needs the refused version hears why at once, not `stale_weights`.
    let mut needs_refused = request.clone();
    needs_refused["min_weight_version"] = json!(2);
    let reply = serving
        .ask_until(&needs_refused, "the refused refit was never reported", |reply| {
            reply["error"]["type"] != "stale_weights"
        })
        .await;
    assert_eq!(reply["error"]["type"], "refit_failed", "{reply}");
    assert!(reply["error"]["message"].as_str().unwrap().contains("version 2"), "{reply}");

    // Weights from outside the generator's path roots are refused, the path named.
    let update = json!({"run_id": "r1", "version": 3, "path": "/usr/lib"});
    client.publish(subjects.weights_updated("r1"), update.to_string().into()).await.unwrap();
    needs_refused["min_weight_version"] = json!(3);
    let reply = serving
        .ask_until(&needs_refused, "the refit from outside the roots was never refused", |reply| {
            reply["error"]["message"].as_str().is_some_and(|m| m.contains("version 3"))
        })
        .await;
    assert_eq!(reply["error"]["type"], "refit_failed", "{reply}");
    assert!(reply["error"]["message"].as_str().unwrap().contains("`/usr/lib` is outside"), "{reply}");
    assert_eq!(refits(&stats), 1);
    serving.stop().await;
}

/// A rollout whose caller gives up (its `Keel-Timeout-Ms` passes) is abandoned: the engine
/// stops decoding its samples at once instead of finishing work nobody will read.
#[tokio::test(flavor = "multi_thread")]
async fn a_rollout_whose_caller_gave_up_stops_at_the_generator() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let first = model(dir.path(), "first", Preset::Tiny, 1);
    let serving = Serving::start(&first, 1024).await;
    let (client, subjects, stats) = (&serving.client, &serving.subjects, serving.stats());
    // 4 samples of 1000 tokens: far longer than the caller's 300 ms.
    let request = json!({"run_id": "r1", "prompt_token_ids": [5, 88, 17], "n": 4, "max_tokens": 1000,
        "sampling": {"temperature": 1.0}, "ignore_eos": true});
    let deadline = Instant::now() + Duration::from_secs(20);
    let asked = loop {
        let headers = async_nats::HeaderMap::new();
        let sent = keel_service::nats::request(
            client,
            subjects.generate("r1"),
            headers,
            request.to_string().into_bytes(),
            Duration::from_millis(300),
        )
        .await;
        match sent {
            Err(e) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                assert!(Instant::now() < deadline, "no generator answered");
            }
            other => break other,
        }
    };
    let gave_up = Instant::now();
    // The caller times out, or (the two clocks racing) hears the generator give up first.
    let gave_up_first = |m: &async_nats::Message| String::from_utf8_lossy(&m.payload).contains("timeout passed");
    match &asked {
        Err(e) => assert_eq!(e.kind(), async_nats::RequestErrorKind::TimedOut),
        Ok(message) => assert!(gave_up_first(message), "{message:?}"),
    }
    // The samples leave the engine at its next step; poll with a deadline.
    while stats.running.load(Ordering::Relaxed) > 0 || stats.waiting.load(Ordering::Relaxed) > 0 {
        assert!(gave_up.elapsed() < Duration::from_secs(10), "the generator is still decoding abandoned samples");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let generated = stats.generated_tokens.load(Ordering::Relaxed);
    assert!(generated < 4 * 1000, "decoding stopped early: {generated} tokens");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(stats.generated_tokens.load(Ordering::Relaxed), generated, "and does not resume");
    serving.stop().await;
}

/// A retry of a rollout still under way (same `request_id`) joins it: both copies get the
/// same reply and the engine generates once.
#[tokio::test(flavor = "multi_thread")]
async fn a_retry_with_the_same_request_id_joins_the_rollout_under_way() {
    use std::sync::atomic::Ordering;
    let dir = tempfile::tempdir().unwrap();
    let first = model(dir.path(), "first", Preset::Tiny, 1);
    let serving = Serving::start(&first, 512).await;
    let stats = serving.stats();
    let ask = |body: Value| serving.ask(body);
    // Warm up (and wait for the subscription) with a request of its own.
    let warm = json!({"run_id": "r1", "prompt_token_ids": [1, 2], "max_tokens": 2, "sampling": {"temperature": 0.0}});
    assert!(ask(warm).await.get("ok").is_some());
    let before = stats.requests_finished.load(Ordering::Relaxed);
    let request = json!({"run_id": "r1", "prompt_token_ids": [5, 88, 17], "n": 2, "max_tokens": 300,
        "sampling": {"temperature": 1.0}, "ignore_eos": true, "request_id": "rollout-7"});
    let (one, two) = tokio::join!(ask(request.clone()), ask(request.clone()));
    assert!(one.get("ok").is_some(), "{one}");
    assert_eq!(one, two, "the retry got the reply of the work it joined");
    assert_eq!(stats.requests_finished.load(Ordering::Relaxed) - before, 1, "generated once");
    // Once finished, the same id runs again (it is no longer in flight).
    let again = ask(request).await;
    assert!(again.get("ok").is_some());
    assert_eq!(stats.requests_finished.load(Ordering::Relaxed) - before, 2);
    serving.stop().await;
}

impl Serving {
    /// Generator `g1`'s reply to `op` for run `r1`'s holder.
    async fn op(&self, op: keel_protocol::subjects::GeneratorOp, body: Value) -> Value {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(keel_protocol::lease::HOLDER_HEADER, "h1");
        let subject = self.subjects.generator("g1", op);
        let reply = self.client.request_with_headers(subject, headers, body.to_string().into()).await.unwrap();
        serde_json::from_slice(&reply.payload).unwrap()
    }

    async fn open_session(&self, key: &str, seed: u64, max_calls: u32) -> Value {
        let limits = json!({"max_calls": max_calls, "max_tokens": 200, "timeout_seconds": 60.0});
        let sampling = json!({"temperature": 1.0, "seed": seed});
        let body = json!({"run_id": "r1", "key": key, "limits": limits, "sampling": sampling});
        self.op(keel_protocol::subjects::GeneratorOp::AgentOpen, body).await
    }

    async fn close_session(&self, key: &str) -> Value {
        self.op(keel_protocol::subjects::GeneratorOp::AgentClose, json!({"run_id": "r1", "key": key})).await
    }

    /// `POST /v1/chat/completions` with `key` as the bearer token: the status and body.
    async fn chat(&self, key: &str, body: Value) -> (u16, Value) {
        let response = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", self.url))
            .bearer_auth(key)
            .json(&body)
            .send()
            .await
            .unwrap();
        (response.status().as_u16(), response.json().await.unwrap())
    }
}

fn ids(value: &Value) -> Vec<i64> {
    value.as_array().unwrap().iter().map(|v| v.as_i64().unwrap()).collect()
}

/// An agent's calls under a session's key are recorded as sampled. The agent sends the
/// model's turn back as text, and the chat template's rendering of that text tokenises into
/// other ids than the model sampled (a case found by sampling until one comes up): the next
/// call's prompt is the first call's prompt and sampled ids as they were, then the rendering's
/// new part; the record the run trains on holds, call by call, exactly the ids each response
/// reported. The key works only while its session is open, and a call past `max_calls` is
/// refused and reported with the record.
#[tokio::test]
async fn an_agent_session_records_the_ids_sampled_where_the_conversation_retokenises() {
    let dir = tempfile::tempdir().unwrap();
    let first = model(dir.path(), "m", Preset::Tiny, 7);
    let serving = Serving::start(&first, 256).await;
    let tokenizer = keel_model::Tokenizer::load(&first).unwrap();
    let end = i64::from(tokenizer.encode(keel_model::init::IM_END, false).unwrap()[0]);
    let user = json!({"role": "user", "content": "what is six times seven"});
    let (status, refused) = serving.chat("keel-agent-nobody", json!({"model": "r1", "messages": [user]})).await;
    assert_eq!(status, 401, "a key with no session is refused: {refused}");
    let mut found = false;
    for seed in 0..60u64 {
        let key = format!("keel-agent-test-{seed}");
        let opened = serving.open_session(&key, seed, 4).await;
        assert!(opened["ok"]["base_url"].as_str().unwrap().ends_with("/v1"), "{opened}");
        assert_eq!(opened["ok"]["model"], "r1", "{opened}");
        // A short turn that ends on the end-of-turn token; the agent's own sampling settings
        // (temperature 0 here) give way to the session's.
        let ask = json!({"model": "r1", "messages": [user], "max_tokens": 10, "min_tokens": 2, "temperature": 0.0,
            "logit_bias": {end.to_string(): 6}, "return_token_ids": true});
        let (status, first_reply) = serving.chat(&key, ask).await;
        assert_eq!(status, 200, "{first_reply}");
        let sampled = ids(&first_reply["choices"][0]["token_ids"]);
        let prompt = ids(&first_reply["prompt_token_ids"]);
        let content = first_reply["choices"][0]["message"]["content"].as_str().unwrap().to_string();
        let said = json!({"role": "assistant", "content": content});
        let rendered = tokenizer.apply_chat_template(&json!([user, said]), false).unwrap();
        let rendered: Vec<i64> = tokenizer.encode(&rendered, false).unwrap().into_iter().map(i64::from).collect();
        let sampled_turn = [prompt.clone(), sampled.clone()].concat();
        if sampled.last() != Some(&end) || rendered.starts_with(&sampled_turn) {
            // Not the case wanted: the turn did not end on its token, or it tokenises back as sampled.
            serving.close_session(&key).await;
            continue;
        }
        found = true;
        let again = json!({"role": "user", "content": "check it"});
        let (status, second_reply) = serving
            .chat(
                &key,
                json!({"model": "r1", "messages": [user, said, again], "max_tokens": 6, "return_token_ids": true}),
            )
            .await;
        assert_eq!(status, 200, "{second_reply}");
        let second_prompt = ids(&second_reply["prompt_token_ids"]);
        assert!(
            second_prompt.starts_with(&sampled_turn),
            "the model continues from the ids it sampled, not from the rendering {rendered:?}: {second_prompt:?}"
        );
        let record = serving.close_session(&key).await;
        let calls = record["ok"]["calls"].as_array().unwrap();
        assert_eq!(calls.len(), 2, "{record}");
        assert_eq!(ids(&calls[0]["token_ids"]), sampled);
        assert_eq!(ids(&calls[0]["prompt_token_ids"]), prompt);
        assert_eq!(calls[1]["continues"], true, "{record}");
        assert_eq!(calls[1]["respliced"], true, "{record}");
        assert_eq!([sampled_turn.clone(), ids(&calls[1]["prompt_token_ids"])].concat(), second_prompt);
        assert_eq!(ids(&calls[1]["token_ids"]), ids(&second_reply["choices"][0]["token_ids"]));
        for call in calls {
            assert_eq!(call["logprobs"].as_array().unwrap().len(), call["token_ids"].as_array().unwrap().len());
        }
        assert_eq!(record["ok"]["violation"], Value::Null);
        let (status, _) = serving.chat(&key, json!({"model": "r1", "messages": [user]})).await;
        assert_eq!(status, 401, "a closed session's key is refused");
        break;
    }
    assert!(found, "no seed gave a turn that re-tokenises differently");

    // A key's text completions would go unrecorded: they are refused.
    serving.open_session("keel-agent-text", 1, 4).await;
    let response = reqwest::Client::new()
        .post(format!("{}/v1/completions", serving.url))
        .bearer_auth("keel-agent-text")
        .json(&json!({"model": "r1", "prompt": "hello", "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 400);
    let refused: Value = response.json().await.unwrap();
    assert!(refused["error"]["message"].as_str().unwrap().contains("/v1/chat/completions only"), "{refused}");
    serving.close_session("keel-agent-text").await;

    let opened = serving.open_session("keel-agent-limited", 1, 1).await;
    assert!(opened["ok"].is_object(), "{opened}");
    let ask = json!({"model": "r1", "messages": [user], "max_tokens": 4});
    assert_eq!(serving.chat("keel-agent-limited", ask.clone()).await.0, 200);
    let (status, over) = serving.chat("keel-agent-limited", ask).await;
    assert_eq!(status, 400, "{over}");
    assert!(over["error"]["message"].as_str().unwrap().contains("max_calls (1)"), "{over}");
    let record = serving.close_session("keel-agent-limited").await;
    assert_eq!(record["ok"]["calls"].as_array().unwrap().len(), 1, "{record}");
    assert!(record["ok"]["violation"].as_str().unwrap().contains("max_calls"), "{record}");
    serving.stop().await;
}
