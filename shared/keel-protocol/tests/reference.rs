//! `docs/src/reference/subjects.md` names every subject `Subjects` builds and every trainer
//! operation: this test fails when a subject is added, renamed or dropped in the code and
//! not on the page.

use keel_protocol::Subjects;
use keel_protocol::subjects::TrainerOp;

#[test]
fn the_subjects_page_names_every_subject_the_code_builds() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/src/reference/subjects.md");
    let page = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let subjects = Subjects::default();
    let worker = "<worker>";
    let mut built = vec![
        subjects.trainer_claim(),
        subjects.generate(),
        subjects.reward_score(),
        subjects.reward_env_step(),
        subjects.checkpoint_created(),
        subjects.checkpoint_deleted(),
        subjects.checkpoint_stream(),
        subjects.weights_updated(),
        subjects.generator_memory(),
        subjects.trainer_send_weights(worker),
        subjects.trainer_weights_meeting(worker),
    ];
    // `….onload` stands for the trainer's onload subject on the page, beside offload's.
    built.extend(
        TrainerOp::ALL.into_iter().filter(|op| *op != TrainerOp::Onload).map(|op| subjects.trainer(worker, op)),
    );
    let missing: Vec<&String> = built.iter().filter(|subject| !page.contains(subject.as_str())).collect();
    assert!(missing.is_empty(), "{path} does not name {missing:?}");
    assert!(page.contains("….onload"), "{path} names the onload operation");
}
