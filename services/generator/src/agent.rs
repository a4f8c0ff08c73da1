//! Agent sessions: a key scoped to one sample of a run, under which an agent outside Keel
//! drives the policy through `/v1/chat/completions`, and the record of every completion made
//! under it, as sampled.
//!
//! The run opens a session on its generator (`agent_open`) before the agent starts and closes
//! it (`agent_close`) once the agent has answered, taking the record: each call's prompt token
//! ids, sampled token ids, logprobs and weight version. The key is accepted as a bearer token
//! in place of the generator's `api_key` while the session is open.
//!
//! Token-in, token-out: an agent sends the conversation back as messages, and the chat
//! template's rendering of the model's earlier turns need not tokenise into the ids the model
//! sampled (a word the model wrote in two tokens that the tokenizer merges, a tool call whose
//! JSON the client re-serialised). When a call's messages are the previous call's messages
//! followed by one assistant turn, the new prompt is the previous call's prompt and sampled
//! ids as they were, then whatever the rendering adds after the previous turn's end-of-turn
//! token ([`splice`]): the model continues from what it really wrote, and the trajectory is
//! one sequence whose every generated token is the one sampled.
//!
//! The session's sampling settings (the run's) replace the agent's, so that the logprobs are
//! of the distribution the trainer scores. Its limits (calls, generated tokens, wall time) are
//! enforced here: a call past one is refused (400) and the first such refusal is reported with
//! the record, which drops the sample.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use keel_generation::request::SampleOut;
use keel_protocol::agent::{AgentCall, AgentLimits, AgentSessionOpen, AgentTrajectory};
use keel_protocol::generator::Sampling;
use serde_json::Value;

/// The open sessions of this generator, by key.
#[derive(Debug, Default)]
pub struct Sessions {
    open: Mutex<HashMap<String, Session>>,
}

#[derive(Debug)]
struct Session {
    run_id: String,
    limits: AgentLimits,
    sampling: Sampling,
    max_call_tokens: usize,
    deadline: Instant,
    calls: Vec<Recorded>,
    /// Calls admitted (recorded or still running).
    admitted: u32,
    /// Tokens generated and tokens promised to calls still running.
    tokens: u64,
    violation: Option<String>,
}

/// One completion as it was sampled.
#[derive(Debug, Clone)]
struct Recorded {
    /// The chat messages the agent sent (normalised as the template reads them).
    messages: Vec<Value>,
    prompt: Vec<i64>,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    version: u64,
    finish: String,
    respliced: bool,
}

/// A request sent with an open session's key (the authentication layer adds it to the
/// request's extensions).
#[derive(Debug, Clone)]
pub struct SessionKey {
    pub key: String,
    pub sessions: Arc<Sessions>,
}

/// A call the session admitted: what it may generate and how.
#[derive(Debug)]
pub struct Admitted {
    pub sampling: Sampling,
    /// The seed of this call (the session's seed, advanced per call), if the run gave one.
    pub seed: Option<u64>,
    /// Tokens this call may generate: what is left of the session's budget, at most the
    /// run's tokens per call.
    pub max_tokens: usize,
    /// The previous call's messages, and its prompt and sampled ids together.
    previous: Option<(Vec<Value>, Vec<i64>)>,
    /// What this call promised out of the budget (given back, less what it used, when it is
    /// recorded).
    promised: u64,
}

fn violation(session: &mut Session, why: String) -> String {
    session.violation.get_or_insert(why).clone()
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Session>> {
        self.open.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Opens a session; a key already open is refused.
    pub fn open(&self, request: &AgentSessionOpen) -> Result<(), String> {
        let mut open = self.lock();
        if open.contains_key(&request.key) {
            return Err("an agent session with this key is already open".into());
        }
        let limits = request.limits;
        if !(limits.timeout_seconds.is_finite() && limits.timeout_seconds > 0.0) || limits.max_calls == 0 {
            return Err("an agent session needs positive limits (max_calls, timeout_seconds)".into());
        }
        let session = Session {
            run_id: request.run_id.clone(),
            limits,
            sampling: request.sampling.clone(),
            max_call_tokens: request.max_call_tokens,
            deadline: Instant::now() + Duration::from_secs_f64(limits.timeout_seconds.min(86_400.0)),
            calls: Vec::new(),
            admitted: 0,
            tokens: 0,
            violation: None,
        };
        open.insert(request.key.clone(), session);
        Ok(())
    }

    pub fn is_open(&self, key: &str) -> bool {
        self.lock().contains_key(key)
    }

    /// Closes run `run_id`'s session `key` and gives what was generated under it.
    pub fn close(&self, run_id: &str, key: &str) -> Result<AgentTrajectory, String> {
        let mut open = self.lock();
        match open.get(key) {
            Some(session) if session.run_id == run_id => {}
            _ => return Err(format!("run {run_id} has no open agent session with this key")),
        }
        let session = open.remove(key).ok_or("the session closed meanwhile")?;
        Ok(trajectory(session))
    }

    /// Closes every session of run `run_id` (the run let the generator go).
    pub fn close_run(&self, run_id: &str) {
        self.lock().retain(|_, session| session.run_id != run_id);
    }

    /// Admits one more call under `key`, or says which limit it goes past (the first such
    /// refusal is kept as the session's violation).
    pub fn admit(&self, key: &str) -> Result<Admitted, String> {
        let mut open = self.lock();
        let session = open.get_mut(key).ok_or("the agent session is closed")?;
        let limits = session.limits;
        if Instant::now() > session.deadline {
            let why = format!("a call came after the sample's time limit ({} s)", limits.timeout_seconds);
            return Err(violation(session, why));
        }
        if session.admitted >= limits.max_calls {
            let why = format!("call {} goes past the sample's max_calls ({})", session.admitted + 1, limits.max_calls);
            return Err(violation(session, why));
        }
        let left = limits.max_tokens.saturating_sub(session.tokens);
        if left == 0 {
            let why = format!("the sample's agent used all of its max_tokens ({})", limits.max_tokens);
            return Err(violation(session, why));
        }
        let whole = usize::try_from(left).unwrap_or(usize::MAX);
        let max_tokens = if session.max_call_tokens == 0 { whole } else { session.max_call_tokens.min(whole) };
        session.admitted += 1;
        session.tokens += max_tokens as u64;
        let seed = session.sampling.seed.map(|seed| seed.wrapping_add(u64::from(session.admitted) * 7_919));
        let previous = session.calls.last().map(|call| {
            let mut ids = call.prompt.clone();
            ids.extend_from_slice(&call.tokens);
            (call.messages.clone(), ids)
        });
        Ok(Admitted { sampling: session.sampling.clone(), seed, max_tokens, previous, promised: max_tokens as u64 })
    }

    /// Gives back what an admitted call promised and did not use (it failed before sampling).
    pub fn forget(&self, key: &str, admitted: &Admitted) {
        if let Some(session) = self.lock().get_mut(key) {
            session.tokens = session.tokens.saturating_sub(admitted.promised);
        }
    }

    /// Records what an admitted call sampled.
    pub fn record(&self, key: &str, admitted: &Admitted, call: Call, sample: &SampleOut) {
        let mut open = self.lock();
        let Some(session) = open.get_mut(key) else { return };
        session.tokens = session.tokens.saturating_sub(admitted.promised) + sample.tokens.len() as u64;
        session.calls.push(Recorded {
            messages: call.messages,
            prompt: call.prompt,
            tokens: sample.tokens.clone(),
            logprobs: sample.logprobs.clone(),
            version: sample.version,
            finish: sample.finish_reason().unwrap_or_else(|| "abort".into()),
            respliced: call.respliced,
        });
    }
}

/// A chat call's prompt under a session.
#[derive(Debug)]
pub struct Call {
    pub messages: Vec<Value>,
    pub prompt: Vec<i64>,
    pub respliced: bool,
}

impl Admitted {
    /// The prompt of a call whose chat template rendered `messages` as `rendered`: when the
    /// messages continue the previous call's (its messages, then one assistant turn), the
    /// previous call's ids as sampled with the rendering's new part after them ([`splice`]);
    /// otherwise the rendering as it is.
    pub fn prompt(&self, messages: Vec<Value>, rendered: Vec<i64>, end_of_turn: &[i64]) -> Call {
        let continued = self.previous.as_ref().filter(|(before, _)| {
            messages.len() > before.len()
                && messages[..before.len()] == before[..]
                && messages[before.len()].get("role").and_then(Value::as_str) == Some("assistant")
        });
        match continued.and_then(|(_, ids)| splice(ids, &rendered, end_of_turn)) {
            Some(prompt) => Call { respliced: prompt != rendered, messages, prompt },
            None => Call { messages, prompt: rendered, respliced: false },
        }
    }
}

/// The prompt that continues `previous` (a call's prompt and sampled ids) where a fresh
/// rendering of the conversation reads `rendered`: `rendered` itself when it starts with
/// `previous`; else, when `previous` ended on an end-of-turn token that occurs k times in
/// it, `previous` then what follows the k-th such token in `rendered`. None when `rendered`
/// has no k-th such token or `previous` did not end on one (a stop string or the length
/// ended it): the call does not continue the conversation token for token.
pub fn splice(previous: &[i64], rendered: &[i64], end_of_turn: &[i64]) -> Option<Vec<i64>> {
    if rendered.starts_with(previous) {
        return Some(rendered.to_vec());
    }
    let end = *previous.last().filter(|t| end_of_turn.contains(t))?;
    let k = previous.iter().filter(|&&t| t == end).count();
    let at = rendered.iter().enumerate().filter(|(_, t)| **t == end).nth(k - 1)?.0;
    let mut prompt = previous.to_vec();
    prompt.extend_from_slice(&rendered[at + 1..]);
    Some(prompt)
}

/// A closed session's record, each call's prompt given as what it adds to the previous
/// call's prompt and completion when it continues them.
fn trajectory(session: Session) -> AgentTrajectory {
    let mut calls = Vec::with_capacity(session.calls.len());
    let mut before: Vec<i64> = Vec::new();
    for (i, call) in session.calls.into_iter().enumerate() {
        let continues = i > 0 && call.prompt.starts_with(&before);
        let prompt_token_ids = if continues { call.prompt[before.len()..].to_vec() } else { call.prompt.clone() };
        before = call.prompt;
        before.extend_from_slice(&call.tokens);
        calls.push(AgentCall {
            continues,
            prompt_token_ids,
            token_ids: call.tokens,
            logprobs: call.logprobs,
            weight_version: call.version,
            finish_reason: call.finish,
            respliced: call.respliced,
        });
    }
    AgentTrajectory { calls, violation: session.violation }
}

#[cfg(test)]
mod tests {
    use super::*;

    const END: i64 = 9;

    #[test]
    fn a_rendering_that_keeps_the_sampled_ids_is_used_as_it_is() {
        let previous = [1, 2, 3, END];
        let rendered = [1, 2, 3, END, 5, 6];
        assert_eq!(splice(&previous, &rendered, &[END]), Some(rendered.to_vec()));
    }

    #[test]
    fn a_retokenised_turn_is_replaced_by_the_ids_sampled() {
        // The model wrote 3 4 (say "4" "2"); the template's rendering tokenises it as 34 ("42").
        let previous = [1, 2, END, 7, 3, 4, END];
        let rendered = [1, 2, END, 7, 34, END, 5, 6];
        assert_eq!(splice(&previous, &rendered, &[END]), Some(vec![1, 2, END, 7, 3, 4, END, 5, 6]));
    }

    #[test]
    fn a_turn_that_did_not_end_on_its_end_of_turn_token_is_not_spliced() {
        assert_eq!(splice(&[1, 2, 3], &[1, 23, END, 5], &[END]), None);
        // Fewer end-of-turn tokens in the rendering than the ids sampled hold.
        assert_eq!(splice(&[1, END, 2, END], &[1, END, 5], &[END]), None);
    }

    fn open(sessions: &Sessions, limits: AgentLimits) {
        let request = AgentSessionOpen {
            run_id: "r".into(),
            key: "k".into(),
            limits,
            min_weight_version: 0,
            sampling: Sampling::default(),
            max_call_tokens: 0,
        };
        sessions.open(&request).unwrap();
    }

    fn sample(tokens: &[i64]) -> SampleOut {
        SampleOut {
            tokens: tokens.to_vec(),
            logprobs: vec![-0.5; tokens.len()],
            finish: Some((keel_generation::request::Finish::Stop, None)),
            ..SampleOut::default()
        }
    }

    #[test]
    fn calls_past_a_limit_are_refused_and_the_first_refusal_is_kept() {
        let sessions = Sessions::default();
        open(&sessions, AgentLimits { max_calls: 2, max_tokens: 5, timeout_seconds: 60.0 });
        let first = sessions.admit("k").unwrap();
        assert_eq!(first.max_tokens, 5);
        let call = first.prompt(vec![Value::from("m")], vec![1, 2], &[END]);
        sessions.record("k", &first, call, &sample(&[3, END]));
        let second = sessions.admit("k").unwrap();
        assert_eq!(second.max_tokens, 3, "two of the five tokens are spent");
        sessions.record("k", &second, Call { messages: vec![], prompt: vec![4], respliced: false }, &sample(&[5]));
        let third = sessions.admit("k").unwrap_err();
        assert!(third.contains("max_calls (2)"), "{third}");
        let record = sessions.close("r", "k").unwrap();
        assert_eq!(record.violation.as_deref(), Some(third.as_str()));
        assert_eq!(record.calls.len(), 2);
        assert!(!record.calls[1].continues, "[4] does not start with [1, 2, 3, END]");
        assert!(!sessions.is_open("k"));
        assert!(sessions.close("r", "k").is_err());
    }

    #[test]
    fn a_session_is_closed_only_by_its_run() {
        let sessions = Sessions::default();
        open(&sessions, AgentLimits { max_calls: 1, max_tokens: 5, timeout_seconds: 60.0 });
        assert!(sessions.close("other", "k").is_err());
        assert!(sessions.is_open("k"));
        sessions.close_run("r");
        assert!(!sessions.is_open("k"));
    }

    #[test]
    fn a_continued_conversation_records_only_what_each_call_adds() {
        let sessions = Sessions::default();
        open(&sessions, AgentLimits { max_calls: 4, max_tokens: 100, timeout_seconds: 60.0 });
        let user = serde_json::json!({"role": "user", "content": "6*7?"});
        let first = sessions.admit("k").unwrap();
        let call = first.prompt(vec![user.clone()], vec![1, 2], &[END]);
        sessions.record("k", &first, call, &sample(&[3, 4, END]));
        let second = sessions.admit("k").unwrap();
        let messages = vec![user, serde_json::json!({"role": "assistant", "content": "42"}), Value::from("tool")];
        let call = second.prompt(messages, vec![1, 2, 34, END, 7, 8], &[END]);
        assert!(call.respliced);
        assert_eq!(call.prompt, vec![1, 2, 3, 4, END, 7, 8]);
        sessions.record("k", &second, call, &sample(&[5, END]));
        let record = sessions.close("r", "k").unwrap();
        assert!(record.calls[1].continues);
        assert_eq!(record.calls[1].prompt_token_ids, vec![7, 8]);
        assert_eq!(record.calls[1].token_ids, vec![5, END]);
        assert_eq!(record.violation, None);
    }
}
