//! `docs/src/reference/subjects.md` names every subject `Subjects` builds and every trainer
//! and generator operation: this test fails when a subject is added, renamed or dropped in the code and
//! not on the page.

use keel_protocol::Subjects;
use keel_protocol::subjects::{GeneratorOp, TrainerOp};

#[test]
fn the_subjects_page_names_every_subject_the_code_builds() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/src/reference/subjects.md");
    let page = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let subjects = Subjects::default();
    let (worker, generator, run) = ("<worker>", "<generator>", "<run>");
    let mut built = vec![
        subjects.trainer_claim(),
        subjects.generator_claim(),
        subjects.generate(run),
        subjects.reward_score(),
        subjects.reward_env_step(),
        subjects.checkpoint_created(),
        subjects.checkpoint_deleted(),
        subjects.checkpoint_stream(),
        subjects.weights_updated(run),
        subjects.generator_memory(run),
        subjects.trainer_send_weights(worker),
        subjects.trainer_weights_meeting(worker),
    ];
    // `….onload` stands for the trainer's onload subject on the page, beside offload's.
    built.extend(
        TrainerOp::ALL.into_iter().filter(|op| *op != TrainerOp::Onload).map(|op| subjects.trainer(worker, op)),
    );
    built.extend(GeneratorOp::ALL.into_iter().map(|op| subjects.generator(generator, op)));
    let missing: Vec<&String> = built.iter().filter(|subject| !page.contains(subject.as_str())).collect();
    assert!(missing.is_empty(), "{path} does not name {missing:?}");
    assert!(page.contains("….onload"), "{path} names the onload operation");
}
