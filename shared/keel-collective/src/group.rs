//! [`RankGroup`]: one thread per rank, each owning that rank's state (its model shard, its
//! cache, its optimiser), driven in lockstep from one caller. Tensor-parallel work is a
//! sequence of calls that every rank makes with the same inputs; the group runs each call
//! on every rank at once and hands back every rank's result.

use std::sync::mpsc;
use std::thread::JoinHandle;

use crate::{Error, Result};

type Job<S> = Box<dyn FnOnce(&mut S) + Send>;

struct Rank<S> {
    jobs: Option<mpsc::Sender<Job<S>>>,
    thread: Option<JoinHandle<()>>,
}

/// The ranks' threads and their states `S`.
pub struct RankGroup<S> {
    ranks: Vec<Rank<S>>,
}

impl<S> std::fmt::Debug for RankGroup<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankGroup").field("ranks", &self.ranks.len()).finish()
    }
}

impl<S: 'static> RankGroup<S> {
    /// Starts one thread per item of `inputs` (rank order) and builds each rank's state on
    /// its own thread with `make(rank, input)`. All ranks build at once (building may
    /// involve collectives); the first failure, by rank, is returned and the group dropped.
    pub fn spawn<I, E>(
        name: &str,
        inputs: Vec<I>,
        make: impl Fn(usize, I) -> std::result::Result<S, E> + Send + Clone + 'static,
    ) -> std::result::Result<Self, E>
    where
        I: Send + 'static,
        E: From<Error> + Send + 'static,
    {
        let mut ranks = Vec::with_capacity(inputs.len());
        let mut built = Vec::with_capacity(inputs.len());
        for (rank, input) in inputs.into_iter().enumerate() {
            let (jobs, queue) = mpsc::channel::<Job<S>>();
            let (ready, outcome) = mpsc::channel::<std::result::Result<(), E>>();
            let make = make.clone();
            let thread = std::thread::Builder::new()
                .name(format!("{name}-rank-{rank}"))
                .spawn(move || {
                    let mut state = match make(rank, input) {
                        Ok(state) => state,
                        Err(e) => {
                            let _ = ready.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready.send(Ok(()));
                    while let Ok(job) = queue.recv() {
                        job(&mut state);
                    }
                })
                .map_err(|e| E::from(Error::Invalid(format!("cannot start the thread of rank {rank}: {e}"))))?;
            ranks.push(Rank { jobs: Some(jobs), thread: Some(thread) });
            built.push(outcome);
        }
        let group = Self { ranks };
        let mut first_error = None;
        for (rank, outcome) in built.into_iter().enumerate() {
            let result = outcome.recv().unwrap_or_else(|_| Err(E::from(Error::Stopped { rank })));
            if let (Err(e), None) = (result, &first_error) {
                first_error = Some(e);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(group),
        }
    }

    pub fn world_size(&self) -> usize {
        self.ranks.len()
    }

    /// Runs `f(state, input)` on every rank at once, `inputs[r]` going to rank r, and
    /// returns the results in rank order. A rank whose thread has ended (it panicked) gives
    /// [`Error::Stopped`].
    pub fn run<I, T>(&self, inputs: Vec<I>, f: impl Fn(&mut S, I) -> T + Send + Clone + 'static) -> Vec<Result<T>>
    where
        I: Send + 'static,
        T: Send + 'static,
    {
        assert_eq!(inputs.len(), self.ranks.len(), "one input per rank");
        let waiting: Vec<_> = self
            .ranks
            .iter()
            .zip(inputs)
            .map(|(rank, input)| {
                let (reply, answer) = mpsc::channel();
                let f = f.clone();
                let job: Job<S> = Box::new(move |state| {
                    let _ = reply.send(f(state, input));
                });
                rank.jobs.as_ref().map(|jobs| jobs.send(job)).transpose().ok().flatten().map(|()| answer)
            })
            .collect();
        waiting
            .into_iter()
            .enumerate()
            .map(|(rank, answer)| answer.and_then(|a| a.recv().ok()).ok_or(Error::Stopped { rank }))
            .collect()
    }

    /// [`RankGroup::run`] with the same (cloned) input on every rank.
    pub fn run_all<I, T>(&self, input: I, f: impl Fn(&mut S, I) -> T + Send + Clone + 'static) -> Vec<Result<T>>
    where
        I: Clone + Send + 'static,
        T: Send + 'static,
    {
        self.run(vec![input; self.ranks.len()], f)
    }
}

/// Rank 0's value from the results of [`RankGroup::run`] whose work returns a `Result`, or
/// an error: when ranks failed, the first one (by rank) that `follows` does not call a
/// consequence of another rank's failure (a collective that timed out or was aborted
/// because a peer left), else the first error.
pub fn rank_zero<T, E: From<Error>>(
    results: Vec<Result<std::result::Result<T, E>>>,
    follows: impl Fn(&E) -> bool,
) -> std::result::Result<T, E> {
    let mut answer = None;
    let mut errors = Vec::new();
    for result in results {
        match result.map_err(E::from).and_then(|r| r) {
            Ok(value) => {
                answer.get_or_insert(value);
            }
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        let cause = errors.iter().position(|e| !follows(e)).unwrap_or(0);
        return Err(errors.swap_remove(cause));
    }
    answer.ok_or_else(|| E::from(Error::Invalid("the rank group is empty".into())))
}

/// Whether `e` is what a rank sees when a peer failed or left: a timeout or an abort.
pub fn is_consequence(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. } | Error::Aborted { .. })
}

impl<S> Drop for RankGroup<S> {
    fn drop(&mut self) {
        for rank in &mut self.ranks {
            rank.jobs.take();
        }
        for rank in &mut self.ranks {
            if let Some(thread) = rank.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::CpuGroup;
    use crate::{Collective, ReduceOp};
    use tch::Tensor;

    #[test]
    fn ranks_run_each_call_together_and_keep_their_state() {
        let comms = CpuGroup::new(3).expect("a group");
        let group = RankGroup::spawn("test", comms, |rank, comm| Ok::<_, Error>((comm, rank as f64))).expect("started");
        for round in 0..3 {
            let results = group.run_all(round as f64, |(comm, value), add| {
                *value += add;
                let mut t = Tensor::from_slice(&[*value]);
                comm.all_reduce(&mut t, ReduceOp::Sum).map(|()| t.double_value(&[0]))
            });
            // Each rank holds rank + 0 + 1 + … + round; the sum over ranks is the same on all.
            let expected: f64 = (0..3).map(|r| r as f64 + (0..=round).sum::<i32>() as f64).sum();
            for result in results {
                assert_eq!(result.expect("ran").expect("reduced"), expected);
            }
        }
    }

    #[test]
    fn a_failed_build_is_reported_by_rank() {
        let error = RankGroup::<()>::spawn("test", vec![0, 1, 2], |rank, _| {
            if rank == 1 { Err(Error::Invalid("rank 1 cannot load".into())) } else { Ok(()) }
        })
        .expect_err("rank 1 fails");
        assert_eq!(error, Error::Invalid("rank 1 cannot load".into()));
    }

    /// Rank 1 fails before a collective that rank 0 enters: rank 0 times out, and the
    /// group's answer is rank 1's error, not rank 0's timeout.
    #[test]
    fn the_failure_that_started_it_is_reported_not_its_consequence() {
        let comms = CpuGroup::with_timeout(2, std::time::Duration::from_millis(300)).expect("a group");
        let group = RankGroup::spawn("test", comms, |_, comm| Ok::<_, Error>(comm)).expect("started");
        let results = group.run_all((), |comm, ()| {
            if comm.rank() == 1 {
                return Err(Error::Invalid("rank 1 ran out of memory".into()));
            }
            let mut t = Tensor::from_slice(&[1.0f32]);
            comm.all_reduce(&mut t, ReduceOp::Sum).map(|()| 0)
        });
        assert!(matches!(&results[0], Ok(Err(Error::Timeout { rank: 0, .. }))), "{results:?}");
        let error = rank_zero(results, is_consequence).expect_err("a rank failed");
        assert_eq!(error, Error::Invalid("rank 1 ran out of memory".into()));
    }

    #[test]
    fn a_rank_that_panicked_is_reported_stopped() {
        let group = RankGroup::spawn("test", vec![0, 1], |_, _| Ok::<_, Error>(())).expect("started");
        let results = group.run(vec![false, true], |_, fail| {
            assert!(!fail, "rank 1 panics");
        });
        assert!(results[0].is_ok());
        let later = group.run_all((), |_, ()| ());
        assert_eq!(later[1], Err(Error::Stopped { rank: 1 }));
    }
}
