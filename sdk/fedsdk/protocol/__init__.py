"""fedsdk's wire protocol: the versioned binary envelope, message types, topic names and validation.

Shared by devices and the coordinator; needs numpy and the standard library only. ``envelope`` is the one
module that serialises; ``messages`` holds frozen, self-validating message types; ``topics`` the topic tree
and message kinds; ``validate`` the semantic checks and the rejection counter. docs/protocol.md describes
the format byte by byte and lists every rejection code.
"""

from __future__ import annotations

from fedsdk.protocol import topics
from fedsdk.protocol.envelope import ENVELOPE_VERSION, MAGIC, Limits, decode, encode
from fedsdk.protocol.fields import DTYPES, FLOAT_DTYPES, FrozenMap, Wire
from fedsdk.protocol.messages import (
    BYE_LEAVING,
    BYE_LOST,
    DATA_MISMATCH,
    DECLINED_PREFIX,
    SCHEMA_VERSION,
    STATUS_STATES,
    Aggregate,
    BaseMessage,
    Bye,
    Error,
    Hello,
    Message,
    Status,
    Task,
    Update,
    is_declined,
    message_class,
    register,
)
from fedsdk.protocol.relay import ModelRequest, SealedModel
from fedsdk.protocol.secagg import (
    MaskedUpdate,
    MaskKeys,
    MaskRelay,
    MaskRoster,
    MaskShares,
    UnmaskRequest,
    UnmaskShares,
)
from fedsdk.protocol.selective import (
    DecryptShare,
    EncryptedAggregate,
    EncryptedUpdate,
    Report,
    ShareBundle,
    Sketch,
    join_parts,
    split_parts,
)
from fedsdk.protocol.topics import MessageKind, parse_up, validate_config_id, validate_id
from fedsdk.protocol.validate import (
    RejectCounter,
    check_aggregate,
    check_kind,
    check_task,
    check_update,
)

__all__ = [
    "BYE_LEAVING",
    "BYE_LOST",
    "DATA_MISMATCH",
    "DECLINED_PREFIX",
    "DTYPES",
    "ENVELOPE_VERSION",
    "FLOAT_DTYPES",
    "MAGIC",
    "SCHEMA_VERSION",
    "STATUS_STATES",
    "Aggregate",
    "BaseMessage",
    "Bye",
    "DecryptShare",
    "EncryptedAggregate",
    "EncryptedUpdate",
    "Error",
    "FrozenMap",
    "Hello",
    "Limits",
    "MaskKeys",
    "MaskRelay",
    "MaskRoster",
    "MaskShares",
    "MaskedUpdate",
    "Message",
    "MessageKind",
    "ModelRequest",
    "RejectCounter",
    "Report",
    "SealedModel",
    "ShareBundle",
    "Sketch",
    "Status",
    "Task",
    "UnmaskRequest",
    "UnmaskShares",
    "Update",
    "Wire",
    "check_aggregate",
    "check_kind",
    "check_task",
    "check_update",
    "decode",
    "encode",
    "is_declined",
    "join_parts",
    "message_class",
    "parse_up",
    "register",
    "split_parts",
    "topics",
    "validate_config_id",
    "validate_id",
]
