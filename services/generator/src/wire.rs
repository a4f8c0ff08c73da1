//! The OpenAI-compatible wire types: request bodies as clients send them and the responses,
//! stream chunks and errors the server writes. `openapi/generator.json` is generated from
//! these and the handlers (see `openai::ApiDoc`) and a test keeps the committed file current.

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

/// A string or a list of strings.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// Text, texts, token ids or lists of token ids: a list is that many prompts, served as
/// independent requests (prompt p's sample i is choice p·n + i).
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<i64>),
    IdLists(Vec<Vec<i64>>),
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct StreamOptions {
    /// Send a last chunk with the token usage.
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and stopping fields both endpoints take.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct Common {
    pub model: String,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// 0 is greedy (default 1).
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    /// -1, 0 or absent: off.
    #[serde(default)]
    #[schema(minimum = -1)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub n: Option<usize>,
    #[serde(default)]
    pub stop: Option<OneOrMany>,
    #[serde(default)]
    pub stop_token_ids: Option<Vec<i64>>,
    /// Tokens generated before a stop token or stop string may end a sample (vLLM's
    /// extension; stop tokens are masked until then).
    #[serde(default)]
    pub min_tokens: Option<usize>,
    /// Sample i of the request uses seed + i; the same seed gives the same output whatever
    /// else the server is doing.
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(default)]
    pub include_stop_str_in_output: bool,
    /// Add `token_ids` (and `prompt_token_ids`) to the response (vLLM's extension).
    #[serde(default)]
    pub return_token_ids: bool,
    /// Only 0 is supported.
    #[serde(default)]
    pub presence_penalty: Option<f64>,
    /// Only 0 is supported.
    #[serde(default)]
    pub frequency_penalty: Option<f64>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    /// Top logprobs per token (0 = only the sampled token's).
    #[serde(default)]
    pub logprobs: Option<usize>,
    /// Return the prompt before the completion: its text, and with `logprobs` its tokens'
    /// logprobs (the first token's null). `max_tokens` may then be 0 (score the prompt only).
    /// Not with `stream`.
    #[serde(default)]
    pub echo: bool,
    /// vLLM's extension: each prompt token's logprob, rank and this many most likely
    /// alternatives, in the choice's `prompt_logprobs`. Not with `stream`.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    #[serde(flatten)]
    pub common: Common,
    /// Every other field: checked by [`crate::fields::check`].
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: serde_json::Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// Chat messages (`role`, `content`), rendered with the model's chat template: at least
    /// one. `content` may be a string, a list of text parts (`{"type": "text", "text": ...}`)
    /// or null.
    #[schema(value_type = Vec<Object>, min_items = 1)]
    pub messages: Value,
    #[serde(default)]
    pub logprobs: bool,
    #[serde(default)]
    pub top_logprobs: Option<usize>,
    #[serde(default = "default_true")]
    pub add_generation_prompt: bool,
    /// Functions the model may call (`{"type": "function", "function": {"name", "description",
    /// "parameters"}}`), given to the chat template; calls come back in `tool_calls` (needs
    /// the generator's `tool_call_parser`).
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// `auto` (default with tools), `none`, `required`, or `{"type": "function", "function":
    /// {"name": ...}}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// Extra variables for the chat template (vLLM's extension), e.g. Qwen3's
    /// `{"enable_thinking": false}`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// vLLM's extension: each prompt token's logprob, rank and this many most likely
    /// alternatives, in the response's `prompt_logprobs`. Not with `stream`.
    #[serde(default)]
    pub prompt_logprobs: Option<usize>,
    #[serde(flatten)]
    pub common: Common,
    /// Every other field: checked by [`crate::fields::check`].
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: serde_json::Map<String, Value>,
}

pub fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    pub fn new(prompt_tokens: usize, completion_tokens: usize) -> Self {
        Self { prompt_tokens, completion_tokens, total_tokens: prompt_tokens + completion_tokens }
    }
}

/// Legacy completion logprobs: per token its text, logprob, the top alternatives by text,
/// and its offset in the completion text. With `echo` the prompt's tokens come first, the
/// first with a null logprob and null alternatives.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    #[schema(value_type = Vec<Option<Object>>)]
    pub top_logprobs: Vec<Option<serde_json::Map<String, Value>>>,
    pub text_offset: Vec<usize>,
}

/// One candidate at a prompt position (vLLM's `prompt_logprobs` entries, keyed by token id).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct PromptLogprob {
    pub logprob: f32,
    /// 1 for the most likely token.
    pub rank: i64,
    pub decoded_token: String,
}

/// Per prompt token, the token itself and the most likely alternatives by token id; the
/// first token's entry is null.
pub type PromptLogprobs = Vec<Option<std::collections::BTreeMap<String, PromptLogprob>>>;

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop`, `length` or `abort`; null while streaming.
    pub finish_reason: Option<String>,
    /// The stop string that ended the sample.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Option<Object>>>)]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

/// A completion, or (object `text_completion` too) one chunk of a stream.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatMessage {
    pub role: String,
    /// Null when the message is only tool calls.
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// A call of one of the request's tools, parsed from the model's output.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ToolCall {
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ToolFunction,
}

#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
pub struct ToolFunction {
    pub name: String,
    /// The arguments as a JSON string, as the model wrote them.
    pub arguments: String,
}

/// A tool call in a stream chunk: whole, in one chunk, with its position among the calls.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ToolCallChunk {
    pub index: usize,
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: ToolFunction,
}

/// In a stream: the role first, then pieces of content, and tool calls once they are whole.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallChunk>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    /// Set in a full response.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessage>,
    /// Set in a stream chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatDelta>,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<i64>>,
}

/// A chat completion (object `chat.completion`) or a stream chunk (`chat.completion.chunk`).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<Option<Object>>>)]
    pub prompt_logprobs: Option<PromptLogprobs>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    pub max_model_len: i64,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// Exactly one of `prompt` and `messages`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub messages: Option<Value>,
    #[serde(default = "default_true")]
    pub add_special_tokens: bool,
    #[serde(default = "default_true")]
    pub add_generation_prompt: bool,
    /// With `messages`: tools given to the chat template, as a chat request gives them.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub tools: Option<Value>,
    /// With `messages`: extra variables for the chat template, as a chat request gives them.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: i64,
    pub tokens: Vec<i64>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    #[schema(schema_with = vocabulary_ids)]
    pub tokens: Vec<i64>,
}

/// Token ids: each from 0 to below the model's vocabulary size, which depends on the model
/// served (an id past it is refused with 400).
fn vocabulary_ids() -> utoipa::openapi::schema::Array {
    use utoipa::openapi::schema::{ArrayBuilder, ObjectBuilder, Type};
    let id = ObjectBuilder::new()
        .schema_type(Type::Integer)
        .format(Some(utoipa::openapi::SchemaFormat::KnownFormat(utoipa::openapi::KnownFormat::Int64)))
        .minimum(Some(0));
    ArrayBuilder::new()
        .items(id)
        .description(Some(
            "Token ids, each from 0 to below the served model's vocabulary size (a larger one is refused with 400)",
        ))
        .build()
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `rate_limit_error` or `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    /// `model_not_found`, `rate_limit_exceeded` or null.
    pub code: Option<String>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorDetail,
}
