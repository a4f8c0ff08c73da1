//! The chat format `keel model init` gives a new model of each family: the special tokens its
//! tokenizer is trained with, the chat template (written for Keel, in the layout the family's
//! own models on the Hub use), and the tokens that begin a sequence, end a turn and pad.
//!
//! | format | families | a turn |
//! |---|---|---|
//! | ChatML | Llama, Qwen, Mistral, the MoEs, OLMo 3, SmolLM3 | `<\|im_start\|>role\ncontent<\|im_end\|>\n` |
//! | Gemma | Gemma 2 and 3 | `<start_of_turn>user\ncontent<end_of_turn>\n` (the assistant is `model`, a system prompt opens the first user turn) |
//! | Phi | Phi-3 / Phi-4-mini | `<\|user\|>content<\|end\|>` |
//! | Tülu | OLMo 2 | `<\|user\|>\ncontent\n`, the assistant's turn ending in `<\|endoftext\|>` |
//! | GLM | GLM-4 | `[gMASK]<sop>` once, then `<\|user\|>\ncontent` |
//! | Granite | Granite | `<\|start_of_role\|>user<\|end_of_role\|>content<\|end_of_text\|>\n` |

use crate::config::Architecture;

/// A family's chat format.
#[derive(Debug, Clone, Copy)]
pub struct ChatFormat {
    /// Special tokens, each a single token of the trained tokenizer.
    pub special: &'static [&'static str],
    pub template: &'static str,
    /// The token a sequence begins with, where the template writes one.
    pub bos: Option<&'static str>,
    /// The token that ends an assistant turn (the tokenizer's `eos_token`).
    pub end_of_turn: &'static str,
    /// Further tokens that end generation (generation_config's `eos_token_id`).
    pub also_end: &'static [&'static str],
    pub pad: &'static str,
}

/// ChatML, refusing roles it does not know.
pub const CHATML: &str = "{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}";

const GEMMA: &str = "{{- bos_token }}
{%- set ns = namespace(system='') %}
{%- for message in messages %}
{%- if message['role'] == 'system' %}
{%- if not loop.first %}{{- raise_exception('A system message must come first') }}{%- endif %}
{%- set ns.system = message['content'] + '\\n\\n' %}
{%- elif message['role'] in ['user', 'assistant'] %}
{%- set role = 'model' if message['role'] == 'assistant' else 'user' %}
{{- '<start_of_turn>' + role + '\\n' + (ns.system if role == 'user' else '') + message['content'] + '<end_of_turn>\\n' }}
{%- if role == 'user' %}{%- set ns.system = '' %}{%- endif %}
{%- else %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\\n' }}
{%- endif %}";

const PHI: &str = "{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{{- '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>' }}
{%- endif %}";

const TULU: &str = "{{- bos_token }}
{%- for message in messages %}
{%- if message['role'] in ['system', 'user'] %}
{{- '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}
{%- elif message['role'] == 'assistant' %}
{{- '<|assistant|>\\n' + message['content'] + eos_token + ('' if loop.last else '\\n') }}
{%- else %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>\\n' }}
{%- endif %}";

const GLM: &str = "{{- '[gMASK]<sop>' }}
{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{{- '<|' + message['role'] + '|>\\n' + message['content'] }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>\\n' }}
{%- endif %}";

const GRANITE: &str = "{%- for message in messages %}
{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('Unknown role: ' + message['role']) }}
{%- endif %}
{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + message['content'] + '<|end_of_text|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|start_of_role|>assistant<|end_of_role|>' }}
{%- endif %}";

impl ChatFormat {
    pub fn of(architecture: Architecture) -> Self {
        use Architecture as A;
        match architecture {
            A::Gemma2 | A::Gemma3 => Self {
                special: &["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"],
                template: GEMMA,
                bos: Some("<bos>"),
                end_of_turn: "<end_of_turn>",
                also_end: &["<eos>"],
                pad: "<pad>",
            },
            A::Phi3 => Self {
                special: &["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>"],
                template: PHI,
                bos: None,
                end_of_turn: "<|end|>",
                also_end: &["<|endoftext|>"],
                pad: "<|endoftext|>",
            },
            A::Olmo2 => Self {
                special: &["<|endoftext|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"],
                template: TULU,
                bos: Some("<|endoftext|>"),
                end_of_turn: "<|endoftext|>",
                also_end: &[],
                pad: "<|pad|>",
            },
            A::Glm4 => Self {
                special: &[
                    "<|endoftext|>",
                    "[gMASK]",
                    "<sop>",
                    "<|system|>",
                    "<|user|>",
                    "<|assistant|>",
                    "<|observation|>",
                ],
                template: GLM,
                bos: None,
                end_of_turn: "<|user|>",
                also_end: &["<|endoftext|>", "<|observation|>"],
                pad: "<|endoftext|>",
            },
            A::Granite => Self {
                special: &["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"],
                template: GRANITE,
                bos: None,
                end_of_turn: "<|end_of_text|>",
                also_end: &[],
                pad: "<|end_of_text|>",
            },
            A::Llama | A::Qwen2 | A::Qwen3 | A::Mistral | A::Qwen3Moe | A::Mixtral | A::Olmo3 | A::SmolLm3 => Self {
                special: &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                template: CHATML,
                bos: None,
                end_of_turn: "<|im_end|>",
                also_end: &["<|endoftext|>"],
                pad: "<|endoftext|>",
            },
        }
    }
}
