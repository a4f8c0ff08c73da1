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
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use keel_model::PromptLogprobs as Scores;
use keel_model::Tokenizer;
use keel_model::sampling::SamplingParams;
use keel_service::openapi::BearerAuth;
use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use crate::agent::{Admitted, Call, SessionKey};
use crate::tools::ToolParser;
use crate::wire::{self, *};
use keel_generation::engine::Engine;
use keel_generation::request::{Draft, Event, Finish, GenRequest, Limits, SampleOut, collect};
use keel_generation::text::{Detokenizer, final_text, streamable_len};

/// What the handlers share.
#[derive(Debug, Clone)]
pub struct AppState {
    pub engine: Engine,
    pub tokenizer: Arc<Tokenizer>,
    pub model_name: String,
    /// The dtype it serves in (`f32`, `bf16`, `f16`): what refits are best exported in.
    pub dtype: &'static str,
    /// Where it serves (rank 0's device under tensor parallelism): where weights sent over
    /// a communicator are received.
    pub device: tch::Device,
    /// Communicators kept with trainers for the collective weight transfer.
    pub links: Arc<crate::refit::WeightLinks>,
    pub limits: Limits,
    /// Requests in the system (running or queued); a request that finds none free gets 429.
    pub admission: Arc<Semaphore>,
    /// Requests the server holds at once (running and waiting): `admission`'s permits.
    pub capacity: usize,
    /// How the model writes tool calls (none: requests with tools are refused).
    pub tool_parser: Option<ToolParser>,
    /// What `/tokenizer_info` answers.
    pub tokenizer_info: Arc<serde_json::Map<String, Value>>,
    /// The grammar engine for structured output (none: the tokenizer could not be read for
    /// it, and structured output is refused).
    pub guides: Option<Arc<crate::structured::Guides>>,
}

/// What an OpenAI request can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request is malformed or outside the server's limits; `param` names the field.
    #[error("{message}")]
    InvalidRequest { message: String, param: Option<&'static str> },
    #[error("The model `{requested}` does not exist (this server serves `{served}`).")]
    ModelNotFound { requested: String, served: String },
    #[error("the server's queue is full; retry later")]
    QueueFull,
    /// The engine thread is gone; the reason is logged, not sent.
    #[error("the engine is unavailable")]
    EngineUnavailable(keel_generation::Error),
}

impl ApiError {
    fn bad(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self::InvalidRequest { message: message.into(), param }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        answer(&self).into_response()
    }
}

/// The one place this service's errors become statuses and OpenAI's error objects
/// (`type`, `message`, `param`, `code`).
fn answer(error: &ApiError) -> keel_service::ApiError {
    let (status, kind, param, code) = match error {
        ApiError::InvalidRequest { param, .. } => (StatusCode::BAD_REQUEST, "invalid_request_error", *param, None),
        ApiError::ModelNotFound { .. } => {
            (StatusCode::NOT_FOUND, "invalid_request_error", Some("model"), Some("model_not_found"))
        }
        ApiError::QueueFull => (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", None, Some("rate_limit_exceeded")),
        ApiError::EngineUnavailable(reason) => {
            tracing::error!("{reason}");
            (StatusCode::SERVICE_UNAVAILABLE, "server_error", None, None)
        }
    };
    let answer = keel_service::ApiError::new(status, kind, error.to_string()).with("param", param).with("code", code);
    if status == StatusCode::TOO_MANY_REQUESTS { answer.retry_after(1) } else { answer }
}

type ApiResult<T> = Result<T, ApiError>;

/// The paths [`routes`] serves.
pub const PATHS: [&str; 8] = [
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/models/{model}",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/metrics",
];

pub fn routes(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{model}", get(model))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/tokenizer_info", get(tokenizer_info_route))
        .route("/metrics", get(metrics))
        .with_state(state)
}

/// JSON bodies with OpenAI-style errors for malformed input. A number with a zero fraction
/// (`2.0`) is taken where an integer is expected, as JSON Schema's `integer` allows
/// ([`keel_service::json::integral_numbers`]).
#[derive(Debug)]
pub struct ApiJson<T>(T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> axum::extract::FromRequest<S> for ApiJson<T> {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, Self::Rejection> {
        let (parts, body) = req.into_parts();
        let headers = parts.headers.clone();
        let request = axum::extract::Request::from_parts(parts, body);
        let bytes = axum::body::Bytes::from_request(request, state)
            .await
            .map_err(|rejection| ApiError::bad(rejection.body_text(), None))?;
        let mut request = axum::extract::Request::new(axum::body::Body::from(bytes.clone()));
        *request.headers_mut() = headers;
        let rejection = match Json::<T>::from_request(request, state).await {
            Ok(Json(value)) => return Ok(Self(value)),
            Err(rejection) => rejection,
        };
        if matches!(rejection, axum::extract::rejection::JsonRejection::JsonDataError(_))
            && let Ok(mut value) = serde_json::from_slice::<Value>(&bytes)
            && keel_service::json::integral_numbers(&mut value)
            && let Ok(decoded) = serde_json::from_value(value)
        {
            return Ok(Self(decoded));
        }
        Err(ApiError::bad(rejection.body_text(), None))
    }
}

impl AppState {
    fn check_model(&self, name: &str) -> ApiResult<()> {
        if name == self.model_name {
            return Ok(());
        }
        Err(ApiError::ModelNotFound { requested: name.to_string(), served: self.model_name.clone() })
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
            min_tokens: common.min_tokens.unwrap_or(0),
        };
        self.limits.check(draft).map_err(|e| ApiError::bad(e.message, Some(e.param)))
    }

    /// OpenAI's `logit_bias`: token ids (as strings) to a bias from -100 to 100, added to their
    /// logits before sampling.
    fn logit_bias(&self, extra: &serde_json::Map<String, Value>) -> ApiResult<Vec<(i64, f32)>> {
        let bad = |message: String| ApiError::bad(message, Some("logit_bias"));
        let Some(value) = extra.get("logit_bias").filter(|v| !v.is_null()) else { return Ok(Vec::new()) };
        let map = value.as_object().ok_or_else(|| bad("logit_bias maps token ids to biases".into()))?;
        let vocab = self.limits.vocab_size;
        map.iter()
            .map(|(id, bias)| {
                let token = id.parse::<i64>().ok().filter(|t| (0..vocab).contains(t));
                let token =
                    token.ok_or_else(|| bad(format!("{id} is not a token id of the vocabulary (size {vocab})")))?;
                let bias = bias.as_f64().filter(|b| (-100.0..=100.0).contains(b));
                let bias =
                    bias.ok_or_else(|| bad(format!("the bias of token {id} must be a number from -100 to 100")))?;
                Ok((token, bias as f32))
            })
            .collect()
    }

    /// The constraint of a request's structured output, if it asks for one.
    fn guide(&self, extra: &serde_json::Map<String, Value>) -> ApiResult<Option<keel_generation::guide::Guide>> {
        crate::structured::guide(self.guides.as_deref(), extra)
            .map_err(|(field, message)| ApiError::bad(message, Some(field)))
    }

    /// Places in the queue for `requests` requests, or 429.
    fn admit(&self, requests: usize) -> ApiResult<OwnedSemaphorePermit> {
        if requests > self.capacity {
            let message = format!(
                "{requests} prompts are more than this server holds at once ({}: max_num_seqs + max_waiting); \
                 send them in smaller requests",
                self.capacity
            );
            return Err(ApiError::bad(message, Some("prompt")));
        }
        let requests = u32::try_from(requests).map_err(|_| ApiError::QueueFull)?;
        self.admission.clone().try_acquire_many_owned(requests).map_err(|_| ApiError::QueueFull)
    }
}

/// Runs `request` to completion.
async fn run_to_end(state: &AppState, request: GenRequest) -> ApiResult<Vec<SampleOut>> {
    let (tx, rx) = mpsc::unbounded_channel();
    let n = request.n;
    state.engine.submit(request, tx).map_err(ApiError::EngineUnavailable)?;
    collect(rx, n).await.map_err(|e| ApiError::bad(e.to_string(), None))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str) -> String {
    format!("{prefix}-{:016x}", rand::random::<u64>())
}

/// Completion-style logprobs of tokens `from..`, text offsets starting at `offset`.
fn completion_logprobs(state: &AppState, s: &SampleOut, from: usize, offset: usize) -> CompletionLogprobs {
    let tokens: Vec<String> = s.tokens[from..].iter().map(|&t| state.token_text(t)).collect();
    let mut text_offset = Vec::with_capacity(tokens.len());
    let mut at = offset;
    for t in &tokens {
        text_offset.push(at);
        at += t.len();
    }
    let top_logprobs =
        (from..s.tokens.len()).map(|i| Some(top_logprob_map(state, &s.top[i], s.tokens[i], s.logprobs[i]))).collect();
    let token_logprobs = s.logprobs[from..].iter().copied().map(Some).collect();
    CompletionLogprobs { tokens, token_logprobs, top_logprobs, text_offset }
}

/// An echoed prompt's part of completion logprobs: its tokens from the first (whose logprob
/// and alternatives are null), each with its `top` most likely alternatives.
fn echoed_logprobs(state: &AppState, prompt: &[i64], scores: &Scores, top: usize) -> CompletionLogprobs {
    let tokens: Vec<String> = prompt.iter().map(|&t| state.token_text(t)).collect();
    let text_offset = tokens.iter().scan(0, |at, t| Some(std::mem::replace(at, *at + t.len()))).collect();
    let mut token_logprobs = vec![None];
    let mut top_logprobs = vec![None];
    for (i, &logprob) in scores.logprobs.iter().enumerate() {
        token_logprobs.push(Some(logprob));
        let alternatives = &scores.top[i][..top.min(scores.top[i].len())];
        top_logprobs.push(Some(top_logprob_map(state, alternatives, prompt[i + 1], logprob)));
    }
    CompletionLogprobs { tokens, token_logprobs, top_logprobs, text_offset }
}

/// vLLM's `prompt_logprobs`: per prompt token (the first null) the token itself and its
/// `top` most likely alternatives, keyed by token id.
fn vllm_prompt_logprobs(state: &AppState, prompt: &[i64], scores: &Scores, top: usize) -> wire::PromptLogprobs {
    let entry = |id: i64, logprob: f32, rank: i64| {
        (id.to_string(), wire::PromptLogprob { logprob, rank, decoded_token: state.token_text(id) })
    };
    let mut out = vec![None];
    for (i, &logprob) in scores.logprobs.iter().enumerate() {
        let mut map = std::collections::BTreeMap::new();
        for (rank, &(id, lp)) in scores.top[i].iter().take(top).enumerate() {
            map.extend([entry(id, lp, rank as i64 + 1)]);
        }
        map.extend([entry(prompt[i + 1], logprob, scores.ranks[i])]);
        out.push(Some(map));
    }
    out
}

/// The prompt's tokens scored by the engine (see [`keel_generation::engine::Engine::prompt_logprobs`]).
async fn score(state: &AppState, prompt: &[i64], top: usize) -> ApiResult<Scores> {
    state.engine.prompt_logprobs(prompt.to_vec(), top).await.map_err(ApiError::EngineUnavailable)
}

/// One token's top logprobs as completions return them: most likely first, with the sampled
/// token among them (as OpenAI and vLLM do), keyed by text; a token whose text another key
/// already has is keyed `token_id:<id>` so that no alternative is lost.
fn top_logprob_map(state: &AppState, top: &[(i64, f32)], sampled: i64, logprob: f32) -> serde_json::Map<String, Value> {
    let mut entries = top.to_vec();
    if !entries.is_empty() && !entries.iter().any(|(id, _)| *id == sampled) {
        let at = entries.iter().position(|(_, lp)| *lp < logprob).unwrap_or(entries.len());
        entries.insert(at, (sampled, logprob));
    }
    let mut map = serde_json::Map::new();
    for (id, lp) in entries {
        let text = state.token_text(id);
        let key = if map.contains_key(&text) { format!("token_id:{id}") } else { text };
        map.insert(key, Value::from(lp));
    }
    map
}

/// Chat-style logprobs of tokens `from..`.
fn chat_logprobs(state: &AppState, s: &SampleOut, from: usize) -> ChatLogprobs {
    let top = |id: i64, logprob: f32| {
        let token = state.token_text(id);
        TopLogprob { bytes: token.as_bytes().to_vec(), token, logprob }
    };
    let content = (from..s.tokens.len())
        .map(|i| {
            let TopLogprob { token, logprob, bytes } = top(s.tokens[i], s.logprobs[i]);
            ChatLogprob { token, logprob, bytes, top_logprobs: s.top[i].iter().map(|(id, lp)| top(*id, *lp)).collect() }
        })
        .collect();
    ChatLogprobs { content }
}

/// Validates a completion request into one generation request per prompt: a list of
/// prompts is served as that many independent requests (each with the request's `n` and
/// `seed`), as vLLM serves it.
fn completion_requests(state: &AppState, body: &CompletionRequest) -> ApiResult<Vec<GenRequest>> {
    state.check_model(&body.common.model)?;
    check_fields(&body.extra, &body.common)?;
    let prompts: Vec<Vec<i64>> = match &body.prompt {
        Prompt::Text(text) => vec![state.encode(text, true)?],
        Prompt::Texts(texts) => texts.iter().map(|t| state.encode(t, true)).collect::<ApiResult<_>>()?,
        Prompt::Ids(ids) => vec![ids.clone()],
        Prompt::IdLists(lists) => lists.clone(),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad("prompt must not be an empty list", Some("prompt")));
    }
    if body.common.stream {
        for (field, asked) in [("echo", body.echo), ("prompt_logprobs", body.prompt_logprobs.is_some())] {
            if asked {
                return Err(ApiError::bad(format!("{field} is not served with stream"), Some(field)));
            }
        }
    }
    // Echo with max_tokens 0 scores the prompt only: checked as if for one token.
    let mut common = body.common.clone();
    if !generates(body) {
        (common.max_tokens, common.max_completion_tokens) = (Some(1), None);
    }
    let top = body.logprobs.unwrap_or(0);
    let guide = state.guide(&body.extra)?;
    let bias = state.logit_bias(&body.extra)?;
    prompts
        .into_iter()
        .map(|prompt| {
            let mut request = state.gen_request(&common, prompt, top, Some(16))?;
            request.guide = guide.clone();
            request.logit_bias = bias.clone();
            Ok(request)
        })
        .collect()
}

/// Whether a completion request generates (echo with `max_tokens` 0 only scores its prompt).
fn generates(body: &CompletionRequest) -> bool {
    !(body.echo && body.common.max_completion_tokens.or(body.common.max_tokens) == Some(0))
}

/// The text an echoed prompt comes back as: as sent, or its token ids decoded.
fn echoed_texts(state: &AppState, prompt: &Prompt, requests: &[GenRequest]) -> Vec<String> {
    match prompt {
        Prompt::Text(text) => vec![text.clone()],
        Prompt::Texts(texts) => texts.clone(),
        Prompt::Ids(_) | Prompt::IdLists(_) => requests.iter().map(|r| state.decode(&r.prompt)).collect(),
    }
}

/// Refuses what a request asks that is not served (see [`crate::fields`]).
fn check_fields(extra: &serde_json::Map<String, Value>, common: &Common) -> ApiResult<()> {
    crate::fields::check(extra, common.n.unwrap_or(1)).map_err(|r| ApiError::bad(r.message, Some(r.field)))
}

/// `messages` as chat templates read them: content given as a list of text parts joined
/// into one string, null content (an assistant turn that only calls tools) as "", and the
/// arguments of earlier tool calls, which clients send as JSON strings, as objects (as
/// Hugging Face templates expect them).
fn plain_messages(messages: &Value) -> ApiResult<Value> {
    let mut messages = messages.clone();
    for message in messages.as_array_mut().into_iter().flatten() {
        for call in message.get_mut("tool_calls").and_then(Value::as_array_mut).into_iter().flatten() {
            if let Some(arguments) = call.pointer_mut("/function/arguments")
                && let Some(parsed) = arguments.as_str().and_then(|text| serde_json::from_str::<Value>(text).ok())
            {
                *arguments = parsed;
            }
        }
        let Some(content) = message.get_mut("content") else { continue };
        match content {
            Value::Null => *content = Value::String(String::new()),
            Value::Array(parts) => {
                let mut text = String::new();
                for part in parts.iter() {
                    match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(piece)) => text.push_str(piece),
                        (kind, _) => {
                            let kind = kind.unwrap_or("untyped");
                            let message = format!("content parts of type {kind} are not served: text parts only");
                            return Err(ApiError::bad(message, Some("messages")));
                        }
                    }
                }
                *content = Value::String(text);
            }
            _ => {}
        }
    }
    Ok(messages)
}

/// Validates a chat request: the messages through the chat template.
fn chat_request(state: &AppState, body: &ChatRequest) -> ApiResult<(GenRequest, Option<ToolParser>)> {
    state.check_model(&body.common.model)?;
    check_fields(&body.extra, &body.common)?;
    if body.messages.as_array().is_none_or(|m| m.is_empty()) {
        return Err(ApiError::bad("messages must be a non-empty list", Some("messages")));
    }
    let mut kwargs = body.chat_template_kwargs.clone().unwrap_or_default();
    let (calls, call_guide) = tool_use(state, body, &mut kwargs)?;
    let text = state
        .tokenizer
        .apply_chat_template_with(&plain_messages(&body.messages)?, body.add_generation_prompt, &kwargs)
        .map_err(|e| ApiError::bad(format!("cannot apply the chat template: {e}"), Some("messages")))?;
    let prompt = state.encode(&text, false)?;
    let top = if body.logprobs { body.top_logprobs.unwrap_or(0) } else { 0 };
    let mut request = state.gen_request(&body.common, prompt, top, None)?;
    request.logit_bias = state.logit_bias(&body.extra)?;
    request.guide = match (call_guide, state.guide(&body.extra)?) {
        (Some(_), Some(_)) => {
            let message = "tool_choice required or named cannot be combined with structured output";
            return Err(ApiError::bad(message, Some("tool_choice")));
        }
        (call, asked) => call.or(asked),
    };
    Ok((request, calls))
}

/// The tools of a chat request into the template's variables, the parser its output is read
/// with (`None`: no tools, or `tool_choice: none`), and for `required` or a named function the
/// constraint that makes the model write such a call.
fn tool_use(
    state: &AppState,
    body: &ChatRequest,
    kwargs: &mut serde_json::Map<String, Value>,
) -> ApiResult<(Option<ToolParser>, Option<keel_generation::guide::Guide>)> {
    let tools = body.tools.as_ref().filter(|t| t.as_array().is_none_or(|list| !list.is_empty()));
    let choice = match &body.tool_choice {
        None | Some(Value::Null) => None,
        Some(Value::String(choice)) if choice == "auto" => None,
        Some(Value::String(choice)) if choice == "none" => return Ok((None, None)),
        Some(Value::String(choice)) if choice == "required" => Some(None),
        Some(named) => match named.pointer("/function/name").and_then(Value::as_str) {
            Some(name) if named.get("type").and_then(Value::as_str) == Some("function") => Some(Some(name)),
            _ => {
                let message =
                    "tool_choice is auto, none, required or {\"type\": \"function\", \"function\": {\"name\": ...}}";
                return Err(ApiError::bad(message, Some("tool_choice")));
            }
        },
    };
    let Some(tools) = tools else {
        return match choice {
            None => Ok((None, None)),
            Some(_) => {
                Err(ApiError::bad("tool_choice asks for a call but the request has no tools", Some("tool_choice")))
            }
        };
    };
    let names = crate::tools::tool_names(tools).map_err(|e| ApiError::bad(e, Some("tools")))?;
    let parser = state.tool_parser.ok_or_else(|| {
        ApiError::bad(
            "tools need the generator's tool_call_parser setting (hermes, llama3_json or granite)",
            Some("tools"),
        )
    })?;
    if let Some(Some(name)) = choice
        && !names.iter().any(|n| n == name)
    {
        return Err(ApiError::bad(
            format!("tool_choice names {name}, which is not among the tools"),
            Some("tool_choice"),
        ));
    }
    kwargs.insert("tools".into(), tools.clone());
    let guide = match (choice, state.guides.as_deref()) {
        (None, _) => None,
        (Some(name), Some(guides)) => {
            Some(guides.tool_call(parser, tools, name).map_err(|e| ApiError::bad(e, Some("tools")))?)
        }
        (Some(_), None) => {
            let message = "tool_choice required or named needs structured output, which this model's tokenizer lacks";
            return Err(ApiError::bad(message, Some("tool_choice")));
        }
    };
    Ok((Some(parser), guide))
}

/// Text completion.
#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest,
    responses((status = 200, description = "A completion; with `stream`, server-sent events: each `data` one chunk, a `CompletionResponse` as JSON (with `stream_options.include_usage`, a last one with no choices and the `usage`), then `data: [DONE]`",
            content((CompletionResponse = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = ErrorResponse),
        (status = 404, description = "Unknown model", body = ErrorResponse),
        (status = 429, description = "Queue full; see Retry-After", body = ErrorResponse),
        (status = 503, description = "The engine is not running (the reason is in the server's log)", body = ErrorResponse)))]
pub async fn completions(
    State(state): State<AppState>,
    session: Option<axum::Extension<SessionKey>>,
    ApiJson(body): ApiJson<CompletionRequest>,
) -> ApiResult<Response> {
    if session.is_some() {
        // Its calls would be neither recorded nor counted against the sample's limits.
        let message = "an agent session's key serves /v1/chat/completions only: call that instead";
        return Err(ApiError::bad(message, None));
    }
    let requests = completion_requests(&state, &body)?;
    let permit = state.admit(requests.len())?;
    let id = request_id("cmpl");
    if body.common.stream {
        let options = StreamSettings::of(&body.common, body.logprobs.is_some(), false);
        return Ok(stream(state, requests, options, id, permit, None));
    }
    let prompts: Vec<Vec<i64>> = requests.iter().map(|r| r.prompt.clone()).collect();
    let (include, n) = (requests[0].include_stop_str_in_output, requests[0].n);
    let echoed = if body.echo { echoed_texts(&state, &body.prompt, &requests) } else { Vec::new() };
    // The prompts' scores, for echo with logprobs and for prompt_logprobs.
    let scored = (body.echo && body.logprobs.is_some()) || body.prompt_logprobs.is_some();
    let top = body.prompt_logprobs.unwrap_or(0).max(if body.echo { body.logprobs.unwrap_or(0) } else { 0 });
    let scores = if scored {
        futures::future::try_join_all(prompts.iter().map(|p| score(&state, p, top))).await?
    } else {
        Vec::new()
    };
    let outputs = if generates(&body) {
        futures::future::try_join_all(requests.into_iter().map(|r| run_to_end(&state, r))).await?
    } else {
        let nothing = SampleOut { finish: Some((Finish::Length, None)), ..SampleOut::default() };
        vec![vec![nothing; n]; prompts.len()]
    };
    drop(permit);
    // Prompt p's sample i is choice p·n + i.
    let mut choices = Vec::new();
    for (p, samples) in outputs.iter().enumerate() {
        let echo = echoed.get(p).map_or("", String::as_str);
        for (i, s) in samples.iter().enumerate() {
            let logprobs = body.logprobs.map(|k| {
                let generated = completion_logprobs(&state, s, 0, echo.len());
                if !body.echo {
                    return generated;
                }
                let mut all = echoed_logprobs(&state, &prompts[p], &scores[p], k);
                all.tokens.extend(generated.tokens);
                all.token_logprobs.extend(generated.token_logprobs);
                all.top_logprobs.extend(generated.top_logprobs);
                all.text_offset.extend(generated.text_offset);
                all
            });
            choices.push(CompletionChoice {
                index: p * n + i,
                text: format!("{echo}{}", final_text(&state.decode(&s.tokens), s.stop(), include)),
                logprobs,
                finish_reason: s.finish_reason(),
                stop_reason: s.stop().map(str::to_string),
                token_ids: body.common.return_token_ids.then(|| s.tokens.clone()),
                prompt_token_ids: body.common.return_token_ids.then(|| prompts[p].clone()),
                prompt_logprobs: body.prompt_logprobs.map(|k| vllm_prompt_logprobs(&state, &prompts[p], &scores[p], k)),
            });
        }
    }
    let completion_tokens = outputs.iter().flatten().map(|s| s.tokens.len()).sum();
    let prompt_tokens = prompts.iter().map(Vec::len).sum();
    Ok(Json(CompletionResponse {
        id,
        object: "text_completion".into(),
        created: now(),
        model: state.model_name.clone(),
        choices,
        usage: Some(Usage::new(prompt_tokens, completion_tokens)),
    })
    .into_response())
}

/// Chat completion through the model's chat template.
#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatRequest,
    responses((status = 200, description = "A chat completion; with `stream`, server-sent events: each `data` one `chat.completion.chunk` as JSON (a `ChatResponse` whose choices carry a `delta`; with `stream_options.include_usage`, a last one with no choices and the `usage`), then `data: [DONE]`",
            content((ChatResponse = "application/json"), (String = "text/event-stream"))),
        (status = 400, description = "Invalid request", body = ErrorResponse),
        (status = 404, description = "Unknown model", body = ErrorResponse),
        (status = 429, description = "Queue full; see Retry-After", body = ErrorResponse),
        (status = 503, description = "The engine is not running (the reason is in the server's log)", body = ErrorResponse)))]
pub async fn chat_completions(
    State(state): State<AppState>,
    session: Option<axum::Extension<SessionKey>>,
    ApiJson(body): ApiJson<ChatRequest>,
) -> ApiResult<Response> {
    let (mut request, calls) = chat_request(&state, &body)?;
    let permit = state.admit(1)?;
    let agent = match session {
        Some(axum::Extension(session)) => Some(agent_call(&state, &body, &mut request, session)?),
        None => None,
    };
    let id = request_id("chatcmpl");
    if body.common.stream {
        let options = StreamSettings::of(&body.common, body.logprobs, true);
        return Ok(stream(state, vec![request], options, id, permit, calls));
    }
    let prompt_ids = request.prompt.clone();
    let include = request.include_stop_str_in_output;
    if body.common.stream && body.prompt_logprobs.is_some() {
        return Err(ApiError::bad("prompt_logprobs is not served with stream", Some("prompt_logprobs")));
    }
    let prompt_logprobs = match body.prompt_logprobs {
        Some(k) => Some(vllm_prompt_logprobs(&state, &prompt_ids, &score(&state, &prompt_ids, k).await?, k)),
        None => None,
    };
    let samples = match (run_to_end(&state, request).await, agent) {
        (Ok(samples), Some((session, admitted, call))) => {
            session.sessions.record(&session.key, &admitted, call, &samples[0]);
            samples
        }
        (Err(e), Some((session, admitted, _))) => {
            session.sessions.forget(&session.key, &admitted);
            return Err(e);
        }
        (samples, None) => samples?,
    };
    drop(permit);
    let choices = samples
        .iter()
        .enumerate()
        .map(|(index, s)| {
            let text = final_text(&state.decode(&s.tokens), s.stop(), include);
            let parsed = match calls {
                Some(parser) => parser.parse(&text),
                None => crate::tools::Parsed { content: Some(text), calls: Vec::new() },
            };
            let called = !parsed.calls.is_empty();
            ChatChoice {
                index,
                message: Some(ChatMessage {
                    role: "assistant".into(),
                    content: parsed.content,
                    tool_calls: called.then_some(parsed.calls),
                }),
                delta: None,
                logprobs: body.logprobs.then(|| chat_logprobs(&state, s, 0)),
                finish_reason: if called { Some("tool_calls".into()) } else { s.finish_reason() },
                stop_reason: s.stop().map(str::to_string),
                token_ids: body.common.return_token_ids.then(|| s.tokens.clone()),
            }
        })
        .collect();
    let completion_tokens = samples.iter().map(|s| s.tokens.len()).sum();
    Ok(Json(ChatResponse {
        id,
        object: "chat.completion".into(),
        created: now(),
        model: state.model_name.clone(),
        choices,
        usage: Some(Usage::new(prompt_ids.len(), completion_tokens)),
        prompt_token_ids: body.common.return_token_ids.then_some(prompt_ids),
        prompt_logprobs,
    })
    .into_response())
}

/// A chat call under an agent session's key ([`crate::agent`]): admitted under the session's
/// limits, its prompt continuing the sampled ids of the session's previous call when its
/// messages continue that call's, sampled with the session's settings.
fn agent_call(
    state: &AppState,
    body: &ChatRequest,
    request: &mut GenRequest,
    session: SessionKey,
) -> ApiResult<(SessionKey, Admitted, Call)> {
    if body.common.stream {
        return Err(ApiError::bad("an agent session's calls are not streamed: send stream false", Some("stream")));
    }
    if request.n != 1 {
        return Err(ApiError::bad("an agent session's calls sample one choice each: send n 1", Some("n")));
    }
    let messages = plain_messages(&body.messages)?.as_array().cloned().unwrap_or_default();
    let admitted = session.sessions.admit(&session.key).map_err(|why| ApiError::bad(why, None))?;
    let call = admitted.prompt(messages, std::mem::take(&mut request.prompt), &state.limits.eos_token_ids);
    let room = state.limits.max_model_len.saturating_sub(call.prompt.len());
    if room == 0 {
        session.sessions.forget(&session.key, &admitted);
        let message = format!(
            "the conversation is {} tokens, the model's whole context ({})",
            call.prompt.len(),
            state.limits.max_model_len
        );
        return Err(ApiError::bad(message, Some("messages")));
    }
    request.prompt = call.prompt.clone();
    request.max_tokens = request.max_tokens.min(admitted.max_tokens).min(room);
    let s = &admitted.sampling;
    request.sampling = SamplingParams {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        min_p: s.min_p,
        seed: admitted.seed.unwrap_or(request.sampling.seed),
    };
    Ok((session, admitted, call))
}

/// What a stream needs to know about its request.
#[derive(Debug, Clone)]
struct StreamSettings {
    logprobs: bool,
    chat: bool,
    include_usage: bool,
}

impl StreamSettings {
    fn of(common: &Common, logprobs: bool, chat: bool) -> Self {
        Self { logprobs, chat, include_usage: common.stream_options.as_ref().is_some_and(|o| o.include_usage) }
    }
}

/// Per-sample streaming state.
#[derive(Default, Clone)]
struct StreamSample {
    out: SampleOut,
    /// The text so far, decoded incrementally.
    text: Detokenizer,
    /// Bytes of text already sent, and tokens whose logprobs were sent.
    sent_text: usize,
    sent_tokens: usize,
    done: bool,
}

/// Builds the chunks of one stream.
#[derive(Clone)]
struct Chunks {
    state: AppState,
    settings: StreamSettings,
    id: String,
    created: u64,
    prompt_len: usize,
    stops: Vec<String>,
    include_stop: bool,
    /// A chat request's tool-call parser: text is shown up to where a call starts, and the
    /// calls are sent whole when the sample ends.
    calls: Option<ToolParser>,
}

impl Chunks {
    fn completion(&self, choices: Vec<CompletionChoice>, usage: Option<Usage>) -> Value {
        let chunk = CompletionResponse {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.state.model_name.clone(),
            choices,
            usage,
        };
        serde_json::to_value(chunk).unwrap_or_default()
    }

    fn chat(&self, choices: Vec<ChatChoice>, usage: Option<Usage>) -> Value {
        let chunk = ChatResponse {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.state.model_name.clone(),
            choices,
            usage,
            prompt_token_ids: None,
            prompt_logprobs: None,
        };
        serde_json::to_value(chunk).unwrap_or_default()
    }

    /// The opening chunk of a chat stream: every choice's role.
    fn opening(&self, n: usize) -> Option<Value> {
        self.settings.chat.then(|| {
            let choices = (0..n)
                .map(|index| ChatChoice {
                    index,
                    message: None,
                    delta: Some(ChatDelta { role: Some("assistant".into()), content: String::new(), tool_calls: None }),
                    logprobs: None,
                    finish_reason: None,
                    stop_reason: None,
                    token_ids: None,
                })
                .collect();
            self.chat(choices, None)
        })
    }

    /// The usage chunk, when asked for.
    fn closing(&self, samples: &[StreamSample]) -> Option<Value> {
        let total = samples.iter().map(|s| s.out.tokens.len()).sum();
        let usage = Some(Usage::new(self.prompt_len, total));
        self.settings
            .include_usage
            .then(|| if self.settings.chat { self.chat(Vec::new(), usage) } else { self.completion(Vec::new(), usage) })
    }

    /// The chunk for sample `index` after its latest event, if there is anything new to show.
    fn update(&self, index: usize, sample: &mut StreamSample) -> Option<Value> {
        let mut tool_calls = None;
        let (visible, finish) = if sample.done {
            let text = self.state.decode(&sample.out.tokens);
            let text = final_text(&text, sample.out.stop(), self.include_stop);
            match self.calls.map(|parser| parser.parse(&text)) {
                Some(parsed) if !parsed.calls.is_empty() => {
                    let chunks = parsed.calls.into_iter().enumerate().map(|(index, call)| ToolCallChunk {
                        index,
                        id: call.id,
                        kind: call.kind,
                        function: call.function,
                    });
                    tool_calls = Some(chunks.collect());
                    (parsed.content.unwrap_or_default(), Some("tool_calls".to_string()))
                }
                _ => (text, sample.out.finish_reason()),
            }
        } else {
            sample.text.update(&self.state.tokenizer, &sample.out.tokens);
            let text = sample.text.text();
            let shown = self.calls.map_or(text.len(), |parser| parser.shown(text));
            (text[..streamable_len(&text[..shown], &self.stops)].to_string(), None)
        };
        // A finished sample always sends its finish reason, even with no text left to show.
        let delta = if visible.len() >= sample.sent_text && visible.is_char_boundary(sample.sent_text) {
            visible[sample.sent_text..].to_string()
        } else if finish.is_some() {
            String::new()
        } else {
            return None;
        };
        if delta.is_empty() && finish.is_none() {
            return None;
        }
        let (from, offset) = (sample.sent_tokens, sample.sent_text);
        sample.sent_text = visible.len().max(sample.sent_text);
        sample.sent_tokens = sample.out.tokens.len();
        let stop_reason = sample.out.stop().map(str::to_string);
        Some(if self.settings.chat {
            let logprobs = self.settings.logprobs.then(|| chat_logprobs(&self.state, &sample.out, from));
            let choice = ChatChoice {
                index,
                message: None,
                delta: Some(ChatDelta { role: None, content: delta, tool_calls }),
                logprobs,
                finish_reason: finish,
                stop_reason,
                token_ids: None,
            };
            self.chat(vec![choice], None)
        } else {
            let logprobs = self.settings.logprobs.then(|| completion_logprobs(&self.state, &sample.out, from, offset));
            let choice = CompletionChoice {
                index,
                text: delta,
                logprobs,
                finish_reason: finish,
                stop_reason,
                token_ids: None,
                prompt_token_ids: None,
                prompt_logprobs: None,
            };
            self.completion(vec![choice], None)
        })
    }
}

/// Streams requests (one per prompt, all with the same `n`) as SSE chunks ending with
/// `data: [DONE]`, prompt p's sample i as choice p·n + i; the permit is held until the
/// stream ends.
fn stream(
    state: AppState,
    requests: Vec<GenRequest>,
    settings: StreamSettings,
    id: String,
    permit: OwnedSemaphorePermit,
    calls: Option<ToolParser>,
) -> Response {
    let n = requests.first().map_or(1, |r| r.n);
    let chunks = Chunks {
        state: state.clone(),
        settings,
        id,
        created: now(),
        prompt_len: requests.iter().map(|r| r.prompt.len()).sum(),
        stops: requests.first().map(|r| r.stop.clone()).unwrap_or_default(),
        include_stop: requests.first().is_some_and(|r| r.include_stop_str_in_output),
        calls,
    };
    let total = n * requests.len();
    let mut receivers = Vec::new();
    for (p, request) in requests.into_iter().enumerate() {
        let (tx, rx) = mpsc::unbounded_channel();
        // A request not submitted drops the receivers of those that were: the engine drops them.
        if let Err(e) = state.engine.submit(request, tx) {
            return ApiError::EngineUnavailable(e).into_response();
        }
        let events = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
        receivers.push(events.map(move |event| (p * n, event)).boxed());
    }
    let merged = futures::stream::select_all(receivers);
    let opening = chunks.opening(total);
    let samples = vec![StreamSample::default(); total];
    let events =
        futures::stream::unfold((merged, samples, false, permit), move |(mut rx, mut samples, ended, permit)| {
            let chunks = chunks.clone();
            async move {
                if ended {
                    return None;
                }
                let Some((first, event)) = rx.next().await else {
                    let closing = chunks.closing(&samples);
                    return Some((closing, (rx, samples, true, permit)));
                };
                let chunk = match event {
                    Event::Token(t) => {
                        let index = first + t.index;
                        samples[index].out.push(t);
                        chunks.update(index, &mut samples[index])
                    }
                    Event::Finished { index, reason, stop, .. } => {
                        let index = first + index;
                        samples[index].out.finish = Some((reason, stop));
                        samples[index].done = true;
                        chunks.update(index, &mut samples[index])
                    }
                    Event::Failed(message) => {
                        let error = ErrorDetail { message, kind: "server_error".into(), param: None, code: None };
                        serde_json::to_value(ErrorResponse { error }).ok()
                    }
                };
                Some((chunk, (rx, samples, false, permit)))
            }
        })
        .filter_map(|chunk| async move { chunk });
    let data = futures::stream::iter(opening)
        .chain(events)
        .map(|chunk| Ok::<_, Infallible>(SseEvent::default().data(chunk.to_string())))
        .chain(futures::stream::once(async { Ok::<_, Infallible>(SseEvent::default().data("[DONE]")) }));
    Sse::new(data).into_response()
}

/// The served model.
#[utoipa::path(get, path = "/v1/models", responses((status = 200, body = ModelList)))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    Json(ModelList { object: "list".into(), data: vec![card(&state)] })
}

/// The model served, by its name (`served_model_name`).
#[utoipa::path(get, path = "/v1/models/{model}", params(("model" = String, Path, description = "The model's name")),
    responses((status = 200, body = ModelCard), (status = 404, description = "Not the model served", body = ErrorResponse)))]
pub async fn model(
    State(state): State<AppState>,
    axum::extract::Path(params): axum::extract::Path<Vec<(String, String)>>,
) -> ApiResult<Json<ModelCard>> {
    // The serving router matched the path first (`crate::Serving`): the last capture is ours.
    let name = params.last().map_or("", |(_, name)| name.as_str());
    state.check_model(name)?;
    Ok(Json(card(&state)))
}

fn card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.model_name.clone(),
        object: "model".into(),
        created: now(),
        owned_by: "keel".into(),
        max_model_len: state.engine.max_model_len,
    }
}

/// Token ids of a prompt, or of messages through the chat template.
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest,
    responses((status = 200, body = TokenizeResponse), (status = 400, body = ErrorResponse)))]
pub async fn tokenize(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<TokenizeRequest>,
) -> ApiResult<Json<TokenizeResponse>> {
    let tokens = match (&body.prompt, &body.messages) {
        (Some(prompt), None) => state.encode(prompt, body.add_special_tokens)?,
        (None, Some(messages)) => {
            let mut kwargs = body.chat_template_kwargs.clone().unwrap_or_default();
            if let Some(tools) = body.tools.as_ref().filter(|t| t.as_array().is_none_or(|list| !list.is_empty())) {
                kwargs.insert("tools".into(), tools.clone());
            }
            let text = state
                .tokenizer
                .apply_chat_template_with(&plain_messages(messages)?, body.add_generation_prompt, &kwargs)
                .map_err(|e| ApiError::bad(format!("cannot apply the chat template: {e}"), Some("messages")))?;
            state.encode(&text, false)?
        }
        _ => return Err(ApiError::bad("give exactly one of `prompt` and `messages`", None)),
    };
    Ok(Json(TokenizeResponse { count: tokens.len(), max_model_len: state.engine.max_model_len, tokens }))
}

/// The text of token ids.
#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest,
    responses((status = 200, body = DetokenizeResponse), (status = 400, body = ErrorResponse)))]
pub async fn detokenize(
    State(state): State<AppState>,
    ApiJson(body): ApiJson<DetokenizeRequest>,
) -> ApiResult<Json<DetokenizeResponse>> {
    let vocab = state.limits.vocab_size;
    if let Some(id) = body.tokens.iter().find(|id| !(0..vocab).contains(*id)) {
        return Err(ApiError::bad(format!("token {id} is out of the vocabulary (size {vocab})"), Some("tokens")));
    }
    let ids: Vec<u32> = body.tokens.iter().map(|&t| t as u32).collect();
    let prompt = state.tokenizer.decode(&ids, false).map_err(|e| ApiError::bad(e.to_string(), None))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// What `/tokenizer_info` says of the tokenizer, as vLLM's route: the model's
/// `tokenizer_config.json` (its chat template and special tokens included; the added-token
/// table left out), `tokenizer_class`, and `model_max_length` as served.
pub fn tokenizer_info(config: Option<std::path::PathBuf>, max_model_len: i64) -> serde_json::Map<String, Value> {
    let read = config.and_then(|path| std::fs::read_to_string(path).ok());
    let mut info = match read.and_then(|text| serde_json::from_str::<Value>(&text).ok()) {
        Some(Value::Object(map)) => map,
        _ => serde_json::Map::new(),
    };
    info.remove("added_tokens_decoder");
    info.entry("tokenizer_class").or_insert_with(|| Value::from("PreTrainedTokenizerFast"));
    info.insert("model_max_length".into(), Value::from(max_model_len));
    info
}

/// The tokenizer's configuration (vLLM's `/tokenizer_info`, which lm-eval and other clients
/// read to tokenize as the server does).
#[utoipa::path(get, path = "/tokenizer_info",
    responses((status = 200, description = "The model's tokenizer_config.json (without added_tokens_decoder), with tokenizer_class and model_max_length", body = Object)))]
pub async fn tokenizer_info_route(State(state): State<AppState>) -> Json<serde_json::Map<String, Value>> {
    Json(state.tokenizer_info.as_ref().clone())
}

/// Prometheus metrics, each labelled with the served model's name (`model_name`): queue depth,
/// running sequences, KV use, tokens, requests finished by reason, latency histograms (time
/// to first token, per output token, between tokens, end to end), decode time, weight
/// version and refits.
#[utoipa::path(get, path = "/metrics", responses((status = 200, description = "Prometheus text format", body = String)))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    let levels = levels(&state);
    static DESCRIBED: std::sync::Once = std::sync::Once::new();
    DESCRIBED.call_once(|| {
        keel_service::metrics::install();
        for (name, help, _) in &levels {
            ::metrics::describe_gauge!(*name, *help);
        }
        ::metrics::describe_counter!(
            LINKS_FORMED,
            "Communicators formed with trainers for the collective weight transfer (a kept one is reused)."
        );
    });
    let labels = [("model_name", state.model_name.as_str())];
    for (name, _, value) in levels {
        keel_service::metrics::set_gauge(name, &labels, value);
    }
    // The generator's, whatever model it serves.
    keel_service::metrics::set_counter(LINKS_FORMED, &[], state.links.formed.load(Ordering::Relaxed));
    keel_service::metrics::response()
}

const LINKS_FORMED: &str = "keel_generator_weight_links_formed_total";

/// The engine's levels now, set on the recorder when it is scraped: name, help and value of
/// each. (Its counters and latencies are recorded as they happen: [`keel_generation::served`].)
fn levels(state: &AppState) -> Vec<(&'static str, &'static str, f64)> {
    let s = &state.engine.stats;
    let count = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let level = |a: &std::sync::atomic::AtomicUsize| a.load(Ordering::Relaxed) as f64;
    let (total, used) = (level(&s.blocks_total), level(&s.blocks_used));
    let ratio = |part: u64, whole: u64| part as f64 / whole.max(1) as f64;
    vec![
        ("keel_generator_queue_depth", "Requests and preempted sequences waiting.", level(&s.waiting)),
        ("keel_generator_running_sequences", "Sequences running now.", level(&s.running)),
        (
            "keel_generator_cuda_kernels_on",
            "Keel CUDA kernels in use (checked against their tch path at start-up).",
            level(&s.kernels_on),
        ),
        (
            "keel_generator_cuda_kernels_off",
            "Keel CUDA kernels switched off at start-up (failed to compile, load or match); their tch path runs.",
            level(&s.kernels_off),
        ),
        (
            "keel_generator_cuda_graph_buckets",
            "Batch sizes whose decode step replays a CUDA graph (0: every step runs eagerly).",
            level(&s.graph_buckets),
        ),
        ("keel_generator_kv_blocks_used", "KV-cache blocks held by sequences.", used),
        ("keel_generator_kv_blocks_free", "KV-cache blocks free or evictable.", total - used),
        ("keel_generator_kv_blocks_used_ratio", "Fraction of KV-cache blocks held.", used / total.max(1.0)),
        (
            "keel_generator_prefix_cache_hit_rate",
            "Prefix-cache hits per block looked up.",
            ratio(count(&s.prefix_hits), count(&s.prefix_queried)),
        ),
        (
            "keel_generator_tokens_per_step",
            "Mean tokens computed per step.",
            ratio(count(&s.step_tokens), count(&s.steps)),
        ),
        ("keel_generator_weight_version", "The weight version being served.", count(&s.weight_version) as f64),
        (
            "keel_generator_asleep",
            "1 while a colocated generator sleeps (KV pool freed for the trainer).",
            level(&s.asleep),
        ),
        (
            "keel_generator_last_refit_seconds",
            "How long the last refit took, drain included.",
            count(&s.last_refit_micros) as f64 / 1e6,
        ),
    ]
}

/// The OpenAPI document: the handlers above with the wire types. The paths name this
/// module in full: utoipa tags each operation with it (`crate::openai`), as the committed
/// document has them.
#[derive(Debug, utoipa::OpenApi)]
#[openapi(
    info(
        title = "Keel generator",
        description = "OpenAI-compatible text generation with continuous batching. Streams are server-sent events of the response objects, ended by `data: [DONE]`."
    ),
    paths(
        crate::openai::completions,
        crate::openai::chat_completions,
        crate::openai::models,
        crate::openai::model,
        crate::openai::tokenize,
        crate::openai::detokenize,
        crate::openai::tokenizer_info_route,
        crate::openai::metrics,
    ),
    components(schemas(ErrorResponse)),
    modifiers(&OpenAiErrors, &BearerAuth)
)]
pub struct ApiDoc;

/// Every operation's 400/401 (and 422 for bodies) with the OpenAI error object.
#[derive(Debug)]
struct OpenAiErrors;

impl utoipa::Modify for OpenAiErrors {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        keel_service::openapi::add_error_responses(openapi, "ErrorResponse");
    }
}

#[cfg(test)]
mod tests {
    use axum::extract::FromRequest;
    use serde_json::json;

    use super::*;
    use axum::http::header;

    /// Every error kind: its status and OpenAI's error object (`type`, `param`, `code`), the
    /// engine's own failure hidden, and `Retry-After` on a full queue.
    #[tokio::test]
    async fn every_error_has_its_status_and_openai_body() {
        let not_found = ApiError::ModelNotFound { requested: "gpt".into(), served: "tiny".into() };
        let cases = vec![
            (
                ApiError::bad("top_k must be -1", Some("top_k")),
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                json!("top_k"),
                Value::Null,
            ),
            (
                ApiError::bad("one prompt", None),
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Value::Null,
                Value::Null,
            ),
            (not_found, StatusCode::NOT_FOUND, "invalid_request_error", json!("model"), json!("model_not_found")),
            (
                ApiError::QueueFull,
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Value::Null,
                json!("rate_limit_exceeded"),
            ),
            (
                ApiError::EngineUnavailable(keel_generation::Error::Request("thread gone".into())),
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                Value::Null,
                Value::Null,
            ),
        ];
        for (error, status, kind, param, code) in cases {
            let text = error.to_string();
            let response = error.into_response();
            assert_eq!(response.status(), status, "{text}");
            assert_eq!(response.headers().contains_key(header::RETRY_AFTER), status == StatusCode::TOO_MANY_REQUESTS);
            let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
            let body: Value = serde_json::from_slice(&body).unwrap();
            let error = body["error"].as_object().unwrap();
            let keys: std::collections::BTreeSet<&str> = error.keys().map(String::as_str).collect();
            assert_eq!(keys, ["code", "message", "param", "type"].into(), "{body}");
            assert_eq!(error["type"], kind, "{text}");
            assert_eq!(error["param"], param, "{text}");
            assert_eq!(error["code"], code, "{text}");
            assert_eq!(error["message"], text.as_str());
            assert!(!text.contains("thread gone"));
        }
    }

    async fn decode<T: serde::de::DeserializeOwned>(body: &str) -> Result<T, ApiError> {
        let request = axum::extract::Request::post("/detokenize")
            .header(header::CONTENT_TYPE, "application/json")
            .body(axum::body::Body::from(body.to_string()))
            .unwrap();
        ApiJson::<T>::from_request(request, &()).await.map(|ApiJson(value)| value)
    }

    /// An integer written `2.0` is taken, as JSON Schema's `integer` allows; a fraction, or a
    /// body that is not JSON, is refused with 400 as before.
    #[tokio::test]
    async fn integers_may_be_written_with_a_zero_fraction() {
        let request: DetokenizeRequest = decode(r#"{"tokens": [1.0, 2, 3e0]}"#).await.unwrap();
        assert_eq!(request.tokens, [1, 2, 3]);
        let request: CompletionRequest = decode(r#"{"model": "m", "prompt": "hi", "max_tokens": 8.0}"#).await.unwrap();
        assert_eq!(request.common.max_tokens, Some(8));
        for body in [r#"{"tokens": [1.5]}"#, r#"{"tokens": [1.0"#] {
            let error = decode::<DetokenizeRequest>(body).await.unwrap_err();
            assert!(matches!(error, ApiError::InvalidRequest { .. }), "{body}: {error}");
        }
        let error = decode::<DetokenizeRequest>(r#"{"tokens": [1.5]}"#).await.unwrap_err();
        assert!(error.to_string().contains("tokens"), "{error}");
    }
}
