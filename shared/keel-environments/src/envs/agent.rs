//! `agent`: the user's agent service. Each sample is one [`AgentRequest`] (`POST`, one
//! attempt: an episode is never run twice, since its completions are already recorded) with
//! the task, the generator endpoint and key the run opened for that sample, and its limits;
//! the agent answers as a reward plugin does. The call's timeout is the sample's wall-time
//! limit. The contract is `openapi/agent.json`.

use futures::future::{BoxFuture, join_all};
use keel_protocol::FieldError;
use keel_protocol::agent::AgentRequest;
use keel_protocol::reward::{AgentConfig, EnvSample, PluginResponse, SampleError};

use super::http::{HttpEnv, outcome};
use super::{Environment, Outcome};

#[derive(Debug)]
pub struct AgentEnv {
    http: HttpEnv,
}

impl AgentEnv {
    /// The environment for `config`, calling through `client` (`private` as for `http`).
    pub fn new(
        config: &AgentConfig,
        client: reqwest::Client,
        private: &keel_service::outbound::PrivateAccess,
    ) -> Result<Self, FieldError> {
        if let Some(problem) = config.problems().into_iter().next() {
            return Err(problem);
        }
        Ok(Self { http: HttpEnv::new(&config.http(), client, private)? })
    }

    async fn episode(&self, sample: &EnvSample) -> Outcome {
        let Some(agent) = &sample.agent else {
            return Err(SampleError::new("invalid_sample", "an agent sample needs the endpoint of its session"));
        };
        let request = AgentRequest {
            messages: sample.messages.clone(),
            metadata: sample.metadata.clone(),
            openai: agent.openai.clone(),
            limits: agent.limits,
        };
        let response: PluginResponse = self.http.call(&request).await?;
        outcome(sample, response)
    }
}

impl Environment for AgentEnv {
    fn step<'a>(&'a self, samples: &'a [EnvSample]) -> BoxFuture<'a, Vec<Outcome>> {
        Box::pin(join_all(samples.iter().map(|sample| self.episode(sample))))
    }
}
