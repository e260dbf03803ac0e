from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "prompt_ids", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs", "n", "json_schema", "json_object", "final_only", "kv_placement", "remote_first_token", "remote_first_logprob", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p", "logit_bias", "truncate_prompt_tokens", "priority", "include_stop_str_in_output", "skip_special_tokens", "return_routed_experts")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    FINAL_ONLY_FIELD_NUMBER: _ClassVar[int]
    KV_PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REMOTE_FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    prompt_ids: TokenIds
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    n: int
    json_schema: str
    json_object: bool
    final_only: bool
    kv_placement: bytes
    remote_first_token: int
    remote_first_logprob: TokenLogprob
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    min_p: float
    logit_bias: _containers.ScalarMap[int, float]
    truncate_prompt_tokens: int
    priority: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    return_routed_experts: bool
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., prompt_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., n: _Optional[int] = ..., json_schema: _Optional[str] = ..., json_object: _Optional[bool] = ..., final_only: _Optional[bool] = ..., kv_placement: _Optional[bytes] = ..., remote_first_token: _Optional[int] = ..., remote_first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., min_p: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., truncate_prompt_tokens: _Optional[int] = ..., priority: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., return_routed_experts: _Optional[bool] = ...) -> None: ...

class DecodePlacement(_message.Message):
    __slots__ = ("placement",)
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    placement: bytes
    def __init__(self, placement: _Optional[bytes] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finished", "finish_reason", "usage", "logprobs", "index", "weight_version", "ttft_s", "stop_string", "stop_token_id", "routed_experts", "routed_experts_shape", "weight_versions", "kv_from_other_weights")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_SHAPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_FROM_OTHER_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finished: bool
    finish_reason: str
    usage: Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    index: int
    weight_version: str
    ttft_s: float
    stop_string: str
    stop_token_id: int
    routed_experts: bytes
    routed_experts_shape: _containers.RepeatedScalarFieldContainer[int]
    weight_versions: _containers.RepeatedCompositeFieldContainer[WeightVersionSpan]
    kv_from_other_weights: bool
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., index: _Optional[int] = ..., weight_version: _Optional[str] = ..., ttft_s: _Optional[float] = ..., stop_string: _Optional[str] = ..., stop_token_id: _Optional[int] = ..., routed_experts: _Optional[bytes] = ..., routed_experts_shape: _Optional[_Iterable[int]] = ..., weight_versions: _Optional[_Iterable[_Union[WeightVersionSpan, _Mapping]]] = ..., kv_from_other_weights: _Optional[bool] = ...) -> None: ...

class WeightVersionSpan(_message.Message):
    __slots__ = ("weight_version", "start")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    start: int
    def __init__(self, weight_version: _Optional[str] = ..., start: _Optional[int] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted", "detail")
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    detail: str
    def __init__(self, aborted: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "architecture", "dtype", "vocab_size", "max_model_len", "num_layers", "num_experts", "num_experts_per_tok", "hidden_size", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "ep_size", "has_tokenizer", "weight_bytes_experts", "weight_bytes_attention", "weight_bytes_embeddings", "weight_bytes_other", "expert_weight_format", "expert_group_size", "expert_checkpoint_format", "expert_zero_points", "device", "kernel_backends", "experts_per_rank", "weight_version", "eplb_enabled", "eplb_rebalances")
    class KernelBackendsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_PER_TOK_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_BATCHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_ATTENTION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_OTHER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXPERT_CHECKPOINT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    EXPERT_ZERO_POINTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPLB_ENABLED_FIELD_NUMBER: _ClassVar[int]
    EPLB_REBALANCES_FIELD_NUMBER: _ClassVar[int]
    model: str
    architecture: str
    dtype: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    hidden_size: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    ep_size: int
    has_tokenizer: bool
    weight_bytes_experts: int
    weight_bytes_attention: int
    weight_bytes_embeddings: int
    weight_bytes_other: int
    expert_weight_format: str
    expert_group_size: int
    expert_checkpoint_format: str
    expert_zero_points: bool
    device: str
    kernel_backends: _containers.ScalarMap[str, str]
    experts_per_rank: _containers.RepeatedCompositeFieldContainer[RankExperts]
    weight_version: str
    eplb_enabled: bool
    eplb_rebalances: int
    def __init__(self, model: _Optional[str] = ..., architecture: _Optional[str] = ..., dtype: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_experts_per_tok: _Optional[int] = ..., hidden_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_kv_blocks: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., max_num_batched_tokens: _Optional[int] = ..., ep_size: _Optional[int] = ..., has_tokenizer: _Optional[bool] = ..., weight_bytes_experts: _Optional[int] = ..., weight_bytes_attention: _Optional[int] = ..., weight_bytes_embeddings: _Optional[int] = ..., weight_bytes_other: _Optional[int] = ..., expert_weight_format: _Optional[str] = ..., expert_group_size: _Optional[int] = ..., expert_checkpoint_format: _Optional[str] = ..., expert_zero_points: _Optional[bool] = ..., device: _Optional[str] = ..., kernel_backends: _Optional[_Mapping[str, str]] = ..., experts_per_rank: _Optional[_Iterable[_Union[RankExperts, _Mapping]]] = ..., weight_version: _Optional[str] = ..., eplb_enabled: _Optional[bool] = ..., eplb_rebalances: _Optional[int] = ...) -> None: ...

class RankExperts(_message.Message):
    __slots__ = ("experts",)
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, experts: _Optional[_Iterable[int]] = ...) -> None: ...

class GetServerStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerStats(_message.Message):
    __slots__ = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "kv_blocks_used", "num_preemptions", "prompt_tokens_total", "generation_tokens_total", "num_finished", "num_aborted", "kv_cache_usage", "num_rejected", "ep_size", "dispatch_bytes_sent", "combine_bytes_sent", "min_dispatch_bytes", "tokens_dispatched", "tokens_received", "ranks", "prefix_cache_queries", "prefix_cache_hits", "kv_cached_blocks", "kv_groups", "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos", "spec_decode_mean_acceptance_length", "state_slots_total", "state_slots_free", "paused", "weight_version", "eplb")
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    NUM_PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    GENERATION_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    NUM_FINISHED_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    COMBINE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    MIN_DISPATCH_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_DISPATCHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_GROUPS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFTS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_FIELD_NUMBER: _ClassVar[int]
    SPEC_DECODE_MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    STATE_SLOTS_FREE_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    EPLB_FIELD_NUMBER: _ClassVar[int]
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_finished: int
    num_aborted: int
    kv_cache_usage: float
    num_rejected: int
    ep_size: int
    dispatch_bytes_sent: int
    combine_bytes_sent: int
    min_dispatch_bytes: int
    tokens_dispatched: int
    tokens_received: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankStats]
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_cached_blocks: int
    kv_groups: _containers.RepeatedCompositeFieldContainer[KVCacheGroupStats]
    spec_decode_num_drafts: int
    spec_decode_num_draft_tokens: int
    spec_decode_num_accepted_tokens: int
    spec_decode_num_accepted_tokens_per_pos: _containers.RepeatedScalarFieldContainer[int]
    spec_decode_mean_acceptance_length: float
    state_slots_total: int
    state_slots_free: int
    paused: bool
    weight_version: str
    eplb: EplbStats
    def __init__(self, num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., num_preemptions: _Optional[int] = ..., prompt_tokens_total: _Optional[int] = ..., generation_tokens_total: _Optional[int] = ..., num_finished: _Optional[int] = ..., num_aborted: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_rejected: _Optional[int] = ..., ep_size: _Optional[int] = ..., dispatch_bytes_sent: _Optional[int] = ..., combine_bytes_sent: _Optional[int] = ..., min_dispatch_bytes: _Optional[int] = ..., tokens_dispatched: _Optional[int] = ..., tokens_received: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankStats, _Mapping]]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., kv_cached_blocks: _Optional[int] = ..., kv_groups: _Optional[_Iterable[_Union[KVCacheGroupStats, _Mapping]]] = ..., spec_decode_num_drafts: _Optional[int] = ..., spec_decode_num_draft_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens: _Optional[int] = ..., spec_decode_num_accepted_tokens_per_pos: _Optional[_Iterable[int]] = ..., spec_decode_mean_acceptance_length: _Optional[float] = ..., state_slots_total: _Optional[int] = ..., state_slots_free: _Optional[int] = ..., paused: _Optional[bool] = ..., weight_version: _Optional[str] = ..., eplb: _Optional[_Union[EplbStats, _Mapping]] = ...) -> None: ...

class EplbStats(_message.Message):
    __slots__ = ("num_rebalances", "num_decisions", "moving", "experts_moved", "bytes_sent", "bytes_received", "transfer_seconds", "commit_seconds", "balancedness", "balancedness_predicted", "last_rebalance_step", "rebalances")
    NUM_REBALANCES_FIELD_NUMBER: _ClassVar[int]
    NUM_DECISIONS_FIELD_NUMBER: _ClassVar[int]
    MOVING_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    LAST_REBALANCE_STEP_FIELD_NUMBER: _ClassVar[int]
    REBALANCES_FIELD_NUMBER: _ClassVar[int]
    num_rebalances: int
    num_decisions: int
    moving: bool
    experts_moved: int
    bytes_sent: int
    bytes_received: int
    transfer_seconds: float
    commit_seconds: float
    balancedness: float
    balancedness_predicted: float
    last_rebalance_step: int
    rebalances: _containers.RepeatedCompositeFieldContainer[RebalanceStats]
    def __init__(self, num_rebalances: _Optional[int] = ..., num_decisions: _Optional[int] = ..., moving: _Optional[bool] = ..., experts_moved: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., commit_seconds: _Optional[float] = ..., balancedness: _Optional[float] = ..., balancedness_predicted: _Optional[float] = ..., last_rebalance_step: _Optional[int] = ..., rebalances: _Optional[_Iterable[_Union[RebalanceStats, _Mapping]]] = ...) -> None: ...

class RebalanceStats(_message.Message):
    __slots__ = ("step", "committed_step", "experts_moved", "bytes_sent", "bytes_received", "transfer_seconds", "commit_seconds", "move_steps", "balancedness_before", "balancedness_after_predicted", "balancedness_after_measured")
    STEP_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MOVE_STEPS_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_PREDICTED_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_MEASURED_FIELD_NUMBER: _ClassVar[int]
    step: int
    committed_step: int
    experts_moved: int
    bytes_sent: int
    bytes_received: int
    transfer_seconds: float
    commit_seconds: float
    move_steps: int
    balancedness_before: float
    balancedness_after_predicted: float
    balancedness_after_measured: float
    def __init__(self, step: _Optional[int] = ..., committed_step: _Optional[int] = ..., experts_moved: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., bytes_received: _Optional[int] = ..., transfer_seconds: _Optional[float] = ..., commit_seconds: _Optional[float] = ..., move_steps: _Optional[int] = ..., balancedness_before: _Optional[float] = ..., balancedness_after_predicted: _Optional[float] = ..., balancedness_after_measured: _Optional[float] = ...) -> None: ...

class KVCacheGroupStats(_message.Message):
    __slots__ = ("group", "kind", "sliding_window", "num_layers", "kv_bytes_per_token", "blocks_used")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    SLIDING_WINDOW_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    group: int
    kind: str
    sliding_window: int
    num_layers: int
    kv_bytes_per_token: int
    blocks_used: int
    def __init__(self, group: _Optional[int] = ..., kind: _Optional[str] = ..., sliding_window: _Optional[int] = ..., num_layers: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., blocks_used: _Optional[int] = ...) -> None: ...

class RankStats(_message.Message):
    __slots__ = ("rank", "num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "tokens_received", "dispatch_bytes_sent", "combine_bytes_sent")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    COMBINE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    tokens_received: int
    dispatch_bytes_sent: int
    combine_bytes_sent: int
    def __init__(self, rank: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., tokens_received: _Optional[int] = ..., dispatch_bytes_sent: _Optional[int] = ..., combine_bytes_sent: _Optional[int] = ...) -> None: ...

class GetExpertLoadRequest(_message.Message):
    __slots__ = ("window",)
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    window: bool
    def __init__(self, window: _Optional[bool] = ...) -> None: ...

class LayerExpertLoad(_message.Message):
    __slots__ = ("layer", "tokens_per_expert", "imbalance_ratio", "balancedness", "tokens_per_rank", "rank_imbalance_ratio", "rank_balancedness")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_EXPERT_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_RATIO_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_IMBALANCE_RATIO_FIELD_NUMBER: _ClassVar[int]
    RANK_BALANCEDNESS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    tokens_per_expert: _containers.RepeatedScalarFieldContainer[int]
    imbalance_ratio: float
    balancedness: float
    tokens_per_rank: _containers.RepeatedScalarFieldContainer[int]
    rank_imbalance_ratio: float
    rank_balancedness: float
    def __init__(self, layer: _Optional[int] = ..., tokens_per_expert: _Optional[_Iterable[int]] = ..., imbalance_ratio: _Optional[float] = ..., balancedness: _Optional[float] = ..., tokens_per_rank: _Optional[_Iterable[int]] = ..., rank_imbalance_ratio: _Optional[float] = ..., rank_balancedness: _Optional[float] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("layers", "ep_size", "window_steps")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EP_SIZE_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerExpertLoad]
    ep_size: int
    window_steps: int
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerExpertLoad, _Mapping]]] = ..., ep_size: _Optional[int] = ..., window_steps: _Optional[int] = ...) -> None: ...

class PauseGenerationRequest(_message.Message):
    __slots__ = ("mode",)
    MODE_FIELD_NUMBER: _ClassVar[int]
    mode: str
    def __init__(self, mode: _Optional[str] = ...) -> None: ...

class ResumeGenerationRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class UpdateWeightsFromDisk(_message.Message):
    __slots__ = ("path",)
    PATH_FIELD_NUMBER: _ClassVar[int]
    path: str
    def __init__(self, path: _Optional[str] = ...) -> None: ...

class UpdateWeightsFromDistributed(_message.Message):
    __slots__ = ("tensors", "group_name", "bucket_bytes")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BYTES_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    group_name: str
    bucket_bytes: int
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., group_name: _Optional[str] = ..., bucket_bytes: _Optional[int] = ...) -> None: ...

class UpdateWeightsRequest(_message.Message):
    __slots__ = ("weight_version", "from_disk", "from_distributed", "flush_cache")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    FROM_DISK_FIELD_NUMBER: _ClassVar[int]
    FROM_DISTRIBUTED_FIELD_NUMBER: _ClassVar[int]
    FLUSH_CACHE_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    from_disk: UpdateWeightsFromDisk
    from_distributed: UpdateWeightsFromDistributed
    flush_cache: bool
    def __init__(self, weight_version: _Optional[str] = ..., from_disk: _Optional[_Union[UpdateWeightsFromDisk, _Mapping]] = ..., from_distributed: _Optional[_Union[UpdateWeightsFromDistributed, _Mapping]] = ..., flush_cache: _Optional[bool] = ...) -> None: ...

class InitWeightUpdateGroupRequest(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "backend", "group_name", "timeout_s")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str
    group_name: str
    timeout_s: float
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., backend: _Optional[str] = ..., group_name: _Optional[str] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class DestroyWeightUpdateGroupRequest(_message.Message):
    __slots__ = ("group_name",)
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    group_name: str
    def __init__(self, group_name: _Optional[str] = ...) -> None: ...

class WeightControlResponse(_message.Message):
    __slots__ = ("weight_version", "paused", "num_aborted", "num_kept", "num_retracted", "num_tensors", "num_bytes", "seconds")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_KEPT_FIELD_NUMBER: _ClassVar[int]
    NUM_RETRACTED_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    paused: bool
    num_aborted: int
    num_kept: int
    num_retracted: int
    num_tensors: int
    num_bytes: int
    seconds: float
    def __init__(self, weight_version: _Optional[str] = ..., paused: _Optional[bool] = ..., num_aborted: _Optional[int] = ..., num_kept: _Optional[int] = ..., num_retracted: _Optional[int] = ..., num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
