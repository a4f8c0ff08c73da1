//! Message bodies that may be large. No NATS message exceeds 1 MiB (ARCHITECTURE.md): a body that
//! would is put in the JetStream object store and the message carries an [`ObjectRef`].

use serde::{Deserialize, Serialize};

/// The largest body sent inline; anything bigger goes by reference.
pub const MAX_INLINE_BYTES: usize = 1 << 20;

/// Where a body stored in the JetStream object store lives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjectRef {
    pub bucket: String,
    pub name: String,
}

/// A body carried inline (`{"inline": ...}`) or by reference (`{"object": {"bucket", "name"}}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum Payload<T> {
    Inline(T),
    Object(ObjectRef),
}
