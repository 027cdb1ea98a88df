"""Worker protocol v1 (docs/design.md §4): the frame (``frame``), the messages (``messages``) and their checks
(``checks``), handed on here under one name."""

from core.protocol.checks import check_ids, check_stage_request, check_verify_request, check_verify_response
from core.protocol.frame import (
    BINARY_CONTENT_TYPE,
    JSON_CONTENT_TYPE,
    MAGIC,
    PROTOCOL_VERSION,
    Message,
    decode,
    encode,
    encode_binary,
    encode_json,
    ids_dtype,
    is_json,
    prefix_hash,
)
from core.protocol.messages import (
    MAX_LOGPROBS,
    RECONSTRUCTIONS,
    AskFields,
    ErrorBody,
    InfoResponse,
    SamplingFields,
    StageRequest,
    StageResponse,
    VerifyRequest,
    VerifyResponse,
)

__all__ = [
    "BINARY_CONTENT_TYPE",
    "JSON_CONTENT_TYPE",
    "MAGIC",
    "MAX_LOGPROBS",
    "PROTOCOL_VERSION",
    "RECONSTRUCTIONS",
    "AskFields",
    "ErrorBody",
    "InfoResponse",
    "Message",
    "SamplingFields",
    "StageRequest",
    "StageResponse",
    "VerifyRequest",
    "VerifyResponse",
    "check_ids",
    "check_stage_request",
    "check_verify_request",
    "check_verify_response",
    "decode",
    "encode",
    "encode_binary",
    "encode_json",
    "ids_dtype",
    "is_json",
    "prefix_hash",
]
