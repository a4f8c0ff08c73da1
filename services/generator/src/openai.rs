//! The OpenAI-compatible HTTP API: `/v1/completions`, `/v1/chat/completions` (streaming over
//! SSE with `data: [DONE]`, `stream_options.include_usage`), `/v1/models`, `/tokenize`,
//! `/detokenize`, `/metrics`. Extensions as in vLLM: `top_k`, `min_p`, `stop_token_ids`,
//! `ignore_eos`, `include_stop_str_in_output`, `return_token_ids`. Errors use OpenAI's
//! error object with 4xx codes; a full queue answers 429 with `Retry-After`.
//!
//! Logprobs are those of the distribution the token was sampled from after the temperature,
//! before top-k/top-p/min-p renormalisation (what the trainer recomputes); greedy requests
//! report the unscaled distribution.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use keel_model::Tokenizer;
use keel_model::sampling::SamplingParams;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::engine::Engine;
use crate::request::{Draft, Event, Finish, GenRequest, Limits};
use crate::text::{final_text, streamable_len};

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    pub limits: Limits,
    /// Requests in the system (running or queued); a request that finds none free gets 429.
    pub admission: Arc<Semaphore>,
}

/// An OpenAI error response.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self { status: StatusCode::BAD_REQUEST, kind: "invalid_request_error", message: message.into(), param }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let code = match self.status {
            StatusCode::NOT_FOUND => json!("model_not_found"),
            StatusCode::TOO_MANY_REQUESTS => json!("rate_limit_exceeded"),
            _ => Value::Null,
        };
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": code}});
        let mut response = (self.status, Json(body)).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

type ApiResult<T> = Result<T, ApiError>;

pub fn routes(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// JSON bodies with OpenAI-style errors for malformed input.
#[derive(Debug)]
pub struct ApiJson<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        match Json::<T>::from_request(req, state).await {
            Ok(Json(value)) => Ok(Self(value)),
            Err(rejection) => Err(ApiError::bad(rejection.body_text(), None)),
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<i64>),
    IdLists(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Sampling and stopping fields shared by both endpoints.
#[derive(Debug, Deserialize)]
struct Common {
    model: String,
    #[serde(default)]
    max_tokens: Option<usize>,
    #[serde(default)]
    max_completion_tokens: Option<usize>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    n: Option<usize>,
    #[serde(default)]
    stop: Option<OneOrMany>,
    #[serde(default)]
    stop_token_ids: Option<Vec<i64>>,
    #[serde(default)]
    seed: Option<u64>,
    #[serde(default)]
    stream: bool,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    ignore_eos: bool,
    #[serde(default)]
    include_stop_str_in_output: bool,
    #[serde(default)]
    return_token_ids: bool,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Prompt,
    /// Number of top logprobs per token (0 = only the sampled token's).
    #[serde(default)]
    logprobs: Option<usize>,
    #[serde(flatten)]
    common: Common,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Value,
    #[serde(default)]
    logprobs: bool,
    #[serde(default)]
    top_logprobs: Option<usize>,
    #[serde(default = "default_true")]
    add_generation_prompt: bool,
    #[serde(flatten)]
    common: Common,
}

fn default_true() -> bool {
    true
}

impl AppState {
    fn check_model(&self, name: &str) -> ApiResult<()> {
        if name == self.model_name {
            return Ok(());
        }
        Err(ApiError {
            status: StatusCode::NOT_FOUND,
            kind: "invalid_request_error",
            message: format!("The model `{name}` does not exist (this server serves `{}`).", self.model_name),
            param: Some("model"),
        })
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> ApiResult<Vec<i64>> {
        let ids = self.tokenizer.encode(text, add_special_tokens).map_err(|e| ApiError::bad(e.to_string(), None))?;
        Ok(ids.into_iter().map(i64::from).collect())
    }

    fn decode(&self, ids: &[i64]) -> String {
        let ids: Vec<u32> = ids.iter().map(|&t| t as u32).collect();
        self.tokenizer.decode(&ids, true).unwrap_or_default()
    }

    fn token_text(&self, id: i64) -> String {
        self.tokenizer.decode(&[id as u32], false).unwrap_or_default()
    }

    /// Validates the shared fields into a [`GenRequest`] for `prompt`.
    fn gen_request(
        &self,
        common: &Common,
        prompt: Vec<i64>,
        top_logprobs: usize,
        default_max: Option<usize>,
    ) -> ApiResult<GenRequest> {
        for (name, value) in
            [("presence_penalty", common.presence_penalty), ("frequency_penalty", common.frequency_penalty)]
        {
            if value.is_some_and(|v| v != 0.0) {
                return Err(ApiError::bad(format!("{name} is not supported"), None));
            }
        }
        let top_k = match common.top_k {
            None | Some(-1) | Some(0) => None,
            Some(k) if k >= 1 => Some(k as usize),
            Some(k) => {
                return Err(ApiError::bad(format!("top_k must be -1 (off) or at least 1, got {k}"), Some("top_k")));
            }
        };
        let sampling = SamplingParams {
            temperature: common.temperature.unwrap_or(1.0),
            top_p: common.top_p.unwrap_or(1.0),
            top_k,
            min_p: common.min_p.unwrap_or(0.0),
            seed: common.seed.unwrap_or_else(rand::random),
        };
        let stop = match &common.stop {
            None => Vec::new(),
            Some(OneOrMany::One(s)) => vec![s.clone()],
            Some(OneOrMany::Many(list)) => list.clone(),
        };
        let draft = Draft {
            prompt,
            n: common.n.unwrap_or(1),
            max_tokens: common.max_completion_tokens.or(common.max_tokens).or(default_max),
            sampling,
            stop_token_ids: common.stop_token_ids.clone().unwrap_or_default(),
            stop,
            include_stop_str_in_output: common.include_stop_str_in_output,
            ignore_eos: common.ignore_eos,
            top_logprobs,
        };
        self.limits.check(draft).map_err(|e| ApiError::bad(e.message, Some(e.param)))
    }

    fn admit(&self) -> ApiResult<OwnedSemaphorePermit> {
        self.admission.clone().try_acquire_owned().map_err(|_| ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            message: "the server's queue is full; retry later".into(),
            param: None,
        })
    }
}

/// Everything one sample produced.
#[derive(Debug, Default, Clone)]
struct SampleOut {
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    top: Vec<Vec<(i64, f32)>>,
    finish: Option<(Finish, Option<String>)>,
}

/// Runs `request` to completion.
async fn run_to_end(state: &AppState, request: GenRequest) -> ApiResult<Vec<SampleOut>> {
    let (tx, mut rx) = mpsc::unbounded_channel();
    let n = request.n;
    state.engine.submit(request, tx).map_err(internal)?;
    let mut samples = vec![SampleOut::default(); n];
    while let Some(event) = rx.recv().await {
        match event {
            Event::Token(t) => {
                let s = &mut samples[t.index];
                s.tokens.push(t.token);
                s.logprobs.push(t.logprob);
                s.top.push(t.top);
            }
            Event::Finished { index, reason, stop, .. } => samples[index].finish = Some((reason, stop)),
            Event::Failed(message) => return Err(ApiError::bad(message, None)),
        }
    }
    Ok(samples)
}

fn internal(message: String) -> ApiError {
    tracing::error!("{message}");
    ApiError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        kind: "server_error",
        message: "the engine is unavailable".into(),
        param: None,
    }
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

fn finish_fields(finish: &Option<(Finish, Option<String>)>) -> (Value, Value) {
    match finish {
        Some((reason, stop)) => (json!(reason.as_str()), json!(stop)),
        None => (Value::Null, Value::Null),
    }
}

/// Completion-style logprobs of `tokens` (text offsets relative to the completion).
fn completion_logprobs(state: &AppState, s: &SampleOut, from: usize, offset: usize) -> Value {
    let mut offsets = Vec::new();
    let mut at = offset;
    let tokens: Vec<String> = s.tokens[from..].iter().map(|&t| state.token_text(t)).collect();
    for t in &tokens {
        offsets.push(at);
        at += t.len();
    }
    let top: Vec<Value> = s.top[from..]
        .iter()
        .map(|alts| Value::Object(alts.iter().map(|(id, lp)| (state.token_text(*id), json!(lp))).collect()))
        .collect();
    json!({"tokens": tokens, "token_logprobs": s.logprobs[from..], "top_logprobs": top, "text_offset": offsets})
}

/// Chat-style logprobs of tokens `from..`.
fn chat_logprobs(state: &AppState, s: &SampleOut, from: usize) -> Value {
    let entry = |id: i64, lp: f32| {
        let text = state.token_text(id);
        json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = (from..s.tokens.len())
        .map(|i| {
            let mut e = entry(s.tokens[i], s.logprobs[i]);
            e["top_logprobs"] = Value::Array(s.top[i].iter().map(|(id, lp)| entry(*id, *lp)).collect());
            e
        })
        .collect();
    json!({"content": content})
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

async fn completions(State(state): State<AppState>, ApiJson(body): ApiJson<CompletionRequest>) -> ApiResult<Response> {
    state.check_model(&body.common.model)?;
    let prompts: Vec<Vec<i64>> = match &body.prompt {
        Prompt::Text(text) => vec![state.encode(text, true)?],
        Prompt::Texts(texts) => texts.iter().map(|t| state.encode(t, true)).collect::<ApiResult<_>>()?,
        Prompt::Ids(ids) => vec![ids.clone()],
        Prompt::IdLists(lists) => lists.clone(),
    };
    if prompts.len() != 1 {
        return Err(ApiError::bad("one prompt per request is supported; send several requests", Some("prompt")));
    }
    let prompt = prompts.into_iter().next().unwrap_or_default();
    let top = body.logprobs.unwrap_or(0);
    let request = state.gen_request(&body.common, prompt, top, Some(16))?;
    let permit = state.admit()?;
    let id = request_id("cmpl");
    if body.common.stream {
        return Ok(stream(state, request, body.common, id, body.logprobs.is_some(), false, permit));
    }
    let prompt_len = request.prompt.len();
    let prompt_ids = request.prompt.clone();
    let include = request.include_stop_str_in_output;
    let samples = run_to_end(&state, request).await?;
    drop(permit);
    let mut completion_tokens = 0;
    let choices: Vec<Value> = samples
        .iter()
        .enumerate()
        .map(|(index, s)| {
            completion_tokens += s.tokens.len();
            let stop = s.finish.as_ref().and_then(|f| f.1.as_deref());
            let text = final_text(&state.decode(&s.tokens), stop, include);
            let (finish_reason, stop_reason) = finish_fields(&s.finish);
            let mut choice = json!({"index": index, "text": text, "finish_reason": finish_reason, "stop_reason": stop_reason,
                "logprobs": if body.logprobs.is_some() { completion_logprobs(&state, s, 0, 0) } else { Value::Null }});
            if body.common.return_token_ids {
                choice["token_ids"] = json!(s.tokens);
                choice["prompt_token_ids"] = json!(prompt_ids);
            }
            choice
        })
        .collect();
    Ok(Json(json!({"id": id, "object": "text_completion", "created": now(), "model": state.model_name,
        "choices": choices, "usage": usage(prompt_len, completion_tokens)}))
    .into_response())
}

async fn chat_completions(State(state): State<AppState>, ApiJson(body): ApiJson<ChatRequest>) -> ApiResult<Response> {
    state.check_model(&body.common.model)?;
    if body.messages.as_array().is_none_or(|m| m.is_empty()) {
        return Err(ApiError::bad("messages must be a non-empty list", Some("messages")));
    }
    let text = state
        .tokenizer
        .apply_chat_template(&body.messages, body.add_generation_prompt)
        .map_err(|e| ApiError::bad(format!("cannot apply the chat template: {e}"), Some("messages")))?;
    let prompt = state.encode(&text, false)?;
    let top = if body.logprobs { body.top_logprobs.unwrap_or(0) } else { 0 };
    let request = state.gen_request(&body.common, prompt, top, None)?;
    let permit = state.admit()?;
    let id = request_id("chatcmpl");
    if body.common.stream {
        return Ok(stream(state, request, body.common, id, body.logprobs, true, permit));
    }
    let prompt_len = request.prompt.len();
    let prompt_ids = request.prompt.clone();
    let include = request.include_stop_str_in_output;
    let samples = run_to_end(&state, request).await?;
    drop(permit);
    let mut completion_tokens = 0;
    let choices: Vec<Value> = samples
        .iter()
        .enumerate()
        .map(|(index, s)| {
            completion_tokens += s.tokens.len();
            let stop = s.finish.as_ref().and_then(|f| f.1.as_deref());
            let content = final_text(&state.decode(&s.tokens), stop, include);
            let (finish_reason, stop_reason) = finish_fields(&s.finish);
            let mut choice = json!({"index": index, "message": {"role": "assistant", "content": content},
                "finish_reason": finish_reason, "stop_reason": stop_reason,
                "logprobs": if body.logprobs { chat_logprobs(&state, s, 0) } else { Value::Null }});
            if body.common.return_token_ids {
                choice["token_ids"] = json!(s.tokens);
            }
            choice
        })
        .collect();
    let mut response = json!({"id": id, "object": "chat.completion", "created": now(), "model": state.model_name,
        "choices": choices, "usage": usage(prompt_len, completion_tokens)});
    if body.common.return_token_ids {
        response["prompt_token_ids"] = json!(prompt_ids);
    }
    Ok(Json(response).into_response())
}

/// Per-sample streaming state.
#[derive(Default, Clone)]
struct StreamSample {
    out: SampleOut,
    /// Bytes of text already sent, and tokens whose logprobs were sent.
    sent_text: usize,
    sent_tokens: usize,
    done: bool,
}

/// Streams a request as SSE chunks; the permit is held until the stream ends.
fn stream(
    state: AppState,
    request: GenRequest,
    common: Common,
    id: String,
    logprobs: bool,
    chat: bool,
    permit: OwnedSemaphorePermit,
) -> Response {
    let (tx, rx) = mpsc::unbounded_channel();
    let n = request.n;
    let prompt_len = request.prompt.len();
    let stops = request.stop.clone();
    let include = request.include_stop_str_in_output;
    if let Err(e) = state.engine.submit(request, tx) {
        return internal(e).into_response();
    }
    let include_usage = common.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let created = now();
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let model_name = state.model_name.clone();
    let header = move |choices: Vec<Value>| json!({"id": id, "object": object, "created": created, "model": model_name, "choices": choices});
    let samples = vec![StreamSample::default(); n];
    let first = chat.then(|| {
        let choices = (0..n).map(|i| json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null})).collect();
        header(choices)
    });
    let events =
        futures::stream::unfold((rx, samples, false, permit), move |(mut rx, mut samples, finished, permit)| {
            let state = state.clone();
            let stops = stops.clone();
            let header = header.clone();
            async move {
                if finished {
                    return None;
                }
                let Some(event) = rx.recv().await else {
                    let total: usize = samples.iter().map(|s| s.out.tokens.len()).sum();
                    let tail = include_usage.then(|| {
                        let mut chunk = header(Vec::new());
                        chunk["usage"] = usage(prompt_len, total);
                        chunk
                    });
                    return Some((tail, (rx, samples, true, permit)));
                };
                let index = match event {
                    Event::Token(t) => {
                        let s = &mut samples[t.index].out;
                        s.tokens.push(t.token);
                        s.logprobs.push(t.logprob);
                        s.top.push(t.top);
                        t.index
                    }
                    Event::Finished { index, reason, stop, .. } => {
                        samples[index].out.finish = Some((reason, stop));
                        samples[index].done = true;
                        index
                    }
                    Event::Failed(message) => {
                        let chunk = json!({"error": {"message": message, "type": "server_error"}});
                        return Some((Some(chunk), (rx, samples, false, permit)));
                    }
                };
                let sample = &mut samples[index];
                let text = state.decode(&sample.out.tokens);
                let (visible, finish) = if sample.done {
                    let stop = sample.out.finish.as_ref().and_then(|f| f.1.as_deref());
                    (final_text(&text, stop, include), finish_fields(&sample.out.finish).0)
                } else {
                    let end = streamable_len(&text, &stops);
                    (text[..end].to_string(), Value::Null)
                };
                if visible.len() < sample.sent_text || !visible.is_char_boundary(sample.sent_text.min(visible.len())) {
                    return Some((None, (rx, samples, false, permit)));
                }
                let delta = visible[sample.sent_text..].to_string();
                if delta.is_empty() && finish.is_null() {
                    return Some((None, (rx, samples, false, permit)));
                }
                let lp = if !logprobs {
                    Value::Null
                } else if chat {
                    chat_logprobs(&state, &sample.out, sample.sent_tokens)
                } else {
                    completion_logprobs(&state, &sample.out, sample.sent_tokens, sample.sent_text)
                };
                sample.sent_text = visible.len();
                sample.sent_tokens = sample.out.tokens.len();
                let choice = if chat {
                    json!({"index": index, "delta": {"content": delta}, "logprobs": lp, "finish_reason": finish})
                } else {
                    json!({"index": index, "text": delta, "logprobs": lp, "finish_reason": finish})
                };
                Some((Some(header(vec![choice])), (rx, samples, false, permit)))
            }
        })
        .filter_map(|chunk| async move { chunk })
        .map(|chunk| Ok::<_, Infallible>(SseEvent::default().data(chunk.to_string())));
    let opening = futures::stream::iter(first.map(|c| Ok::<_, Infallible>(SseEvent::default().data(c.to_string()))));
    let done = futures::stream::once(async { Ok::<_, Infallible>(SseEvent::default().data("[DONE]")) });
    Sse::new(opening.chain(events).chain(done)).into_response()
}

async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": state.model_name, "object": "model", "created": now(), "owned_by": "keel",
        "max_model_len": state.engine.max_model_len}]}),
    )
}

#[derive(Debug, Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    messages: Option<Value>,
    #[serde(default = "default_true")]
    add_special_tokens: bool,
    #[serde(default = "default_true")]
    add_generation_prompt: bool,
}

async fn tokenize(State(state): State<AppState>, ApiJson(body): ApiJson<TokenizeRequest>) -> ApiResult<Json<Value>> {
    let tokens = match (&body.prompt, &body.messages) {
        (Some(prompt), None) => state.encode(prompt, body.add_special_tokens)?,
        (None, Some(messages)) => {
            let text = state
                .tokenizer
                .apply_chat_template(messages, body.add_generation_prompt)
                .map_err(|e| ApiError::bad(format!("cannot apply the chat template: {e}"), Some("messages")))?;
            state.encode(&text, false)?
        }
        _ => return Err(ApiError::bad("give exactly one of `prompt` and `messages`", None)),
    };
    Ok(Json(json!({"count": tokens.len(), "max_model_len": state.engine.max_model_len, "tokens": tokens})))
}

#[derive(Debug, Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<i64>,
}

async fn detokenize(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<DetokenizeRequest>,
) -> ApiResult<Json<Value>> {
    if let Some(id) = body.tokens.iter().find(|id| !(0..state.limits.vocab_size).contains(*id)) {
        return Err(ApiError::bad(
            format!("token {id} is out of the vocabulary (size {})", state.limits.vocab_size),
            Some("tokens"),
        ));
    }
    let ids: Vec<u32> = body.tokens.iter().map(|&t| t as u32).collect();
    let prompt = state.tokenizer.decode(&ids, false).map_err(|e| ApiError::bad(e.to_string(), None))?;
    Ok(Json(json!({"prompt": prompt})))
}

async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let s = &state.engine.stats;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let ttft_count = load(&s.ttft_count);
    let body = format!(
        "# HELP keel_generator_queue_depth Requests waiting for slots.\n# TYPE keel_generator_queue_depth gauge\nkeel_generator_queue_depth {}\n\
         # HELP keel_generator_running_sequences Samples decoding now.\n# TYPE keel_generator_running_sequences gauge\nkeel_generator_running_sequences {}\n\
         # HELP keel_generator_kv_slots_used_ratio Fraction of KV-cache slots in use.\n# TYPE keel_generator_kv_slots_used_ratio gauge\nkeel_generator_kv_slots_used_ratio {}\n\
         # HELP keel_generator_generated_tokens_total Tokens generated.\n# TYPE keel_generator_generated_tokens_total counter\nkeel_generator_generated_tokens_total {}\n\
         # HELP keel_generator_prompt_tokens_total Prompt tokens prefilled.\n# TYPE keel_generator_prompt_tokens_total counter\nkeel_generator_prompt_tokens_total {}\n\
         # HELP keel_generator_requests_finished_total Requests finished.\n# TYPE keel_generator_requests_finished_total counter\nkeel_generator_requests_finished_total {}\n\
         # HELP keel_generator_time_to_first_token_seconds Time from arrival to the first token.\n# TYPE keel_generator_time_to_first_token_seconds summary\nkeel_generator_time_to_first_token_seconds_sum {}\nkeel_generator_time_to_first_token_seconds_count {}\n\
         # HELP keel_generator_decode_seconds_total Time spent in decode steps.\n# TYPE keel_generator_decode_seconds_total counter\nkeel_generator_decode_seconds_total {}\n\
         # HELP keel_generator_weight_version The weight version being served.\n# TYPE keel_generator_weight_version gauge\nkeel_generator_weight_version {}\n\
         # HELP keel_generator_refits_total Weight refits done.\n# TYPE keel_generator_refits_total counter\nkeel_generator_refits_total {}\n\
         # HELP keel_generator_last_refit_seconds How long the last refit took, drain included.\n# TYPE keel_generator_last_refit_seconds gauge\nkeel_generator_last_refit_seconds {}\n",
        s.waiting.load(Ordering::Relaxed),
        s.running.load(Ordering::Relaxed),
        s.slots_used.load(Ordering::Relaxed) as f64 / state.engine.slots as f64,
        load(&s.generated_tokens),
        load(&s.prompt_tokens),
        load(&s.requests_finished),
        load(&s.ttft_micros) as f64 / 1e6,
        ttft_count,
        load(&s.decode_micros) as f64 / 1e6,
        load(&s.weight_version),
        load(&s.refits),
        load(&s.last_refit_micros) as f64 / 1e6,
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], body)
}
