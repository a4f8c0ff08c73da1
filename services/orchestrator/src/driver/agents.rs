//! Rollouts of `agent` environments: the user's agent drives the policy itself, through a
//! generator's OpenAI API, under a key scoped to the sample.
//!
//! For each sample the run opens a session on one of its generators (in turn, so a sample's
//! calls all reach one generator and reuse its prefix cache), has the reward service call the
//! agent with the task, the generator's base URL and the key, then closes the session and
//! takes the generator's record of every call: the sample trained on is the first call's
//! prompt, then each call's sampled ids (loss mask 1) with whatever the next call's prompt
//! adds between them (mask 0), token for token as sampled. A sample whose agent failed, timed
//! out, went past a limit or did not continue one conversation is dropped (sample mask 0)
//! with the reason in its `error`; the step goes on.

use futures::future::{join_all, try_join_all};
use keel_protocol::agent::{AgentSessionClose, AgentSessionOpen, AgentSessionOpened, AgentTrajectory};
use keel_protocol::reward::{AgentSample, EnvConfig, EnvSample, EnvStepRequest, EnvStepResult, Message, OnError};

use super::rollout::{Episode, Settings};
use super::tokens::Prompting;
use super::{Result, RunContext, Stop};
use crate::clients::Generator;

/// One sample's session.
struct Opened {
    episode: usize,
    generator: Generator,
    key: String,
    endpoint: AgentSessionOpened,
}

/// Rolls out every live episode of an `agent` environment to its end.
pub async fn roll_out(
    ctx: &RunContext,
    prompting: &Prompting,
    episodes: &mut [Episode],
    settings: &Settings,
    seed: u64,
) -> Result<()> {
    let chosen: Vec<usize> =
        (0..episodes.len()).filter(|&i| !episodes[i].done && matches!(episodes[i].env, EnvConfig::Agent(_))).collect();
    if chosen.is_empty() {
        return Ok(());
    }
    if ctx.generators.is_empty() {
        return Err(Stop::Failed("an agent environment needs the run's generators".into()));
    }
    let max_len = ctx.spec.max_total_sequence_length;
    let opens = chosen.iter().enumerate().map(|(k, &i)| {
        let EnvConfig::Agent(config) = &episodes[i].env else { unreachable!("chosen as agent episodes") };
        let request = AgentSessionOpen {
            run_id: ctx.id.to_string(),
            key: format!("keel-agent-{}", uuid::Uuid::new_v4().simple()),
            limits: config.limits(max_len),
            min_weight_version: settings.weights.1,
            sampling: keel_protocol::generator::Sampling {
                seed: Some(seed.wrapping_add(i as u64 * 104_729)),
                ..settings.sampling.clone()
            },
            max_call_tokens: settings.max_new_tokens,
        };
        let generator = ctx.generators[k % ctx.generators.len()].clone();
        async move {
            let endpoint = open(ctx, &generator, &request, settings).await?;
            Ok::<_, Stop>(Opened { episode: i, generator, key: request.key, endpoint })
        }
    });
    let sessions = try_join_all(opens).await?;
    let stepped = step(ctx, episodes, &sessions).await;
    // Every session is closed, whatever the step did: its key stops working.
    let closes = sessions.iter().map(|s| async {
        let close = AgentSessionClose { run_id: ctx.id.to_string(), key: s.key.clone() };
        s.generator.op(&close).await
    });
    let trajectories = join_all(closes).await;
    let results = stepped?;
    for ((session, trajectory), result) in sessions.iter().zip(trajectories).zip(results) {
        let e = &mut episodes[session.episode];
        let trajectory = trajectory
            .map_err(|e| Stop::Failed(format!("generator {} lost an agent session: {e}", session.generator.id())))?;
        finish(e, prompting, trajectory, result, max_len);
    }
    Ok(())
}

/// Opens `request`'s session on `generator`, once it serves the step's weights
/// ([`super::rollout::on_weights`]).
async fn open(
    ctx: &RunContext,
    generator: &Generator,
    request: &AgentSessionOpen,
    settings: &Settings,
) -> Result<AgentSessionOpened> {
    match super::rollout::on_weights(ctx, &settings.weights, || generator.op(request)).await? {
        Err(e) => Err(Stop::Failed(format!("generator {} cannot open an agent session: {e}", generator.id()))),
        Ok(opened) if opened.base_url.is_empty() => Err(Stop::Failed(format!(
            "generator {} does not know the URL agents reach it at (set its public_url)",
            generator.id()
        ))),
        Ok(opened) => Ok(opened),
    }
}

/// Runs each session's agent through the reward service; one result per session, in order.
async fn step(ctx: &RunContext, episodes: &[Episode], sessions: &[Opened]) -> Result<Vec<EnvStepResult>> {
    let mut calls = Vec::new();
    let envs = sessions.iter().enumerate().map(|(k, s)| (k, &episodes[s.episode].env));
    for chunk in super::rollout::env_chunks(envs) {
        let env = episodes[sessions[chunk[0]].episode].env.clone();
        let EnvConfig::Agent(config) = &env else { unreachable!("agent episodes") };
        let samples = chunk
            .iter()
            .map(|&k| {
                let (s, e) = (&sessions[k], &episodes[sessions[k].episode]);
                EnvSample {
                    messages: e.messages.clone(),
                    metadata: e.metadata.clone(),
                    token_ids: None,
                    agent: Some(AgentSample {
                        openai: keel_protocol::agent::AgentEndpoint {
                            base_url: s.endpoint.base_url.clone(),
                            api_key: s.key.clone(),
                            model: s.endpoint.model.clone(),
                        },
                        limits: config.limits(ctx.spec.max_total_sequence_length),
                    }),
                }
            })
            .collect();
        // An agent that fails drops its sample, never the step.
        calls.push((chunk.clone(), EnvStepRequest { env, on_error: OnError::Skip, samples }));
    }
    let replies = join_all(calls.iter().map(|(_, request)| ctx.nats.ask(request))).await;
    let mut results: Vec<Option<EnvStepResult>> = vec![None; sessions.len()];
    for ((members, _), reply) in calls.into_iter().zip(replies) {
        let reply = reply?;
        if reply.results.len() != members.len() {
            return Err(Stop::Failed(format!(
                "the reward service answered {} agent results for {}",
                reply.results.len(),
                members.len()
            )));
        }
        for (k, result) in members.into_iter().zip(reply.results) {
            results[k] = Some(result);
        }
    }
    Ok(results.into_iter().map(|r| r.expect("every session is in one request")).collect())
}

/// The episode of one agent sample: its reward, and the trajectory its generator recorded.
fn finish(e: &mut Episode, prompting: &Prompting, trajectory: AgentTrajectory, result: EnvStepResult, max_len: usize) {
    e.done = true;
    e.terminated = true;
    e.reward = result.reward;
    e.rewards = result.rewards;
    e.info = result.info;
    e.skipped = result.skipped;
    e.error = result.error.map(|error| error.to_string());
    let calls = &trajectory.calls;
    e.turns = calls.len() as u32;
    let dropped = match (&trajectory.violation, calls.iter().skip(1).position(|c| !c.continues)) {
        _ if e.error.is_some() => None,
        (Some(violation), _) => Some(format!("agent_limit: {violation}")),
        _ if calls.is_empty() => Some("agent_no_calls: the agent made no completion under its key".to_string()),
        (None, Some(k)) => Some(format!(
            "agent_not_one_conversation: call {} does not continue the calls before it (its messages are not \
             theirs followed by the model's turn, or the turn before did not end on its end-of-turn token)",
            k + 2
        )),
        (None, None) => None,
    };
    if let Some(why) = dropped {
        e.error = Some(why);
        e.skipped = true;
    }
    if e.skipped {
        e.reward = 0.0;
        return;
    }
    let sequence = Sequence::of(calls);
    e.prompt_len = calls[0].prompt_token_ids.len();
    e.prompt_text = prompting.decode(&calls[0].prompt_token_ids);
    e.generated = calls.iter().map(|c| c.token_ids.len()).sum();
    for (k, call) in calls.iter().enumerate() {
        if k > 0 && !call.prompt_token_ids.is_empty() {
            e.messages.push(Message::new("environment", prompting.decode(&call.prompt_token_ids)));
        }
        e.messages.push(Message::new("assistant", prompting.decode(&call.token_ids)));
    }
    (e.ids, e.mask, e.gen_logprobs, e.turn_starts) =
        (sequence.ids, sequence.mask, sequence.logprobs, sequence.turn_starts);
    let last = calls.last().expect("a trajectory with calls");
    e.finish_reason = last.finish_reason.clone();
    e.truncated = last.finish_reason == "length";
    if e.ids.len() > max_len {
        e.ids.truncate(max_len);
        e.mask.truncate(max_len);
        e.gen_logprobs.truncate(max_len);
        e.truncated = true;
    }
    // One reward for the whole episode, at its last turn (every turn's reward-to-go).
    e.turn_rewards = vec![0.0; calls.len()];
    e.turn_rewards[calls.len() - 1] = e.reward;
}

/// One conversation's calls as the sequence trained on.
#[derive(Debug, PartialEq)]
struct Sequence {
    ids: Vec<i64>,
    /// 1 on the sampled ids.
    mask: Vec<f32>,
    /// Each sampled id's logprob as the generator reported it (0 elsewhere).
    logprobs: Vec<f32>,
    /// Where each call's sampled ids start.
    turn_starts: Vec<usize>,
}

impl Sequence {
    /// The first call's prompt, then each call's sampled ids after what its prompt adds to
    /// the call before (every call after the first continues it).
    fn of(calls: &[keel_protocol::agent::AgentCall]) -> Self {
        let mut s = Self { ids: Vec::new(), mask: Vec::new(), logprobs: Vec::new(), turn_starts: Vec::new() };
        for call in calls {
            s.ids.extend_from_slice(&call.prompt_token_ids);
            s.mask.resize(s.ids.len(), 0.0);
            s.logprobs.resize(s.ids.len(), 0.0);
            s.turn_starts.push(s.ids.len());
            s.ids.extend_from_slice(&call.token_ids);
            s.mask.resize(s.ids.len(), 1.0);
            s.logprobs.extend_from_slice(&call.logprobs[..call.logprobs.len().min(call.token_ids.len())]);
            s.logprobs.resize(s.ids.len(), 0.0);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_protocol::agent::AgentCall;

    fn call(continues: bool, prompt: &[i64], tokens: &[i64]) -> AgentCall {
        AgentCall {
            continues,
            prompt_token_ids: prompt.to_vec(),
            token_ids: tokens.to_vec(),
            logprobs: tokens.iter().map(|&t| -(t as f32) / 10.0).collect(),
            weight_version: 3,
            finish_reason: "stop".into(),
            respliced: false,
        }
    }

    #[test]
    fn the_sequence_trained_on_is_the_ids_sampled_call_by_call() {
        // Call 1 sampled 5 6 9; call 2's prompt adds 7 8 (a tool's answer) and it samples 4 9.
        let calls = [call(false, &[1, 2, 3], &[5, 6, 9]), call(true, &[7, 8], &[4, 9])];
        let s = Sequence::of(&calls);
        assert_eq!(s.ids, vec![1, 2, 3, 5, 6, 9, 7, 8, 4, 9]);
        assert_eq!(s.mask, vec![0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0]);
        assert_eq!(s.turn_starts, vec![3, 8]);
        for (call, &start) in calls.iter().zip(&s.turn_starts) {
            let end = start + call.token_ids.len();
            assert_eq!(&s.ids[start..end], call.token_ids.as_slice(), "each call's ids, as sampled");
            assert_eq!(&s.logprobs[start..end], call.logprobs.as_slice(), "and their logprobs");
        }
        assert_eq!(s.logprobs[..3], [0.0; 3]);
        assert_eq!(s.logprobs[6..8], [0.0; 2]);
    }
}
