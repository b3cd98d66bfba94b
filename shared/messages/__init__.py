"""Wire messages between gateway, scheduler and workers.

msgspec structs, msgpack on the bus; `array_like` keeps them compact (fields go by
position, not name) and `gc=False` because they hold no cycles. This package imports
nothing heavy so every service (and the gateway's hot path) can load it cheaply.

Naming follows vLLM V1: the scheduler sends full data for requests a worker has not
seen (`NewRequestData`) and only deltas for the ones it holds (`CachedRequestData`).
A module per concern: steps.py (a request in, a step out and back), outputs.py (tokens
and figures to the gateways), control.py (the rest of the bus's talk); this package
names them all.
"""

from shared.messages.control import (  # noqa: F401
    AbortRequests,
    GatewayHeartbeat,
    MetricFamily,
    MetricsQuery,
    SchedulerHeartbeat,
    SchedulerInfo,
    StoredResponse,
    StoredResponseAnswer,
    StoredResponseQuery,
    TokenizeRequest,
    TokenizeResponse,
    WorkerInfo,
)
from shared.messages.images import ImageFeature, PromptWithImages  # noqa: F401
from shared.messages.outputs import (  # noqa: F401
    CUMULATIVE_STATS,
    ITERATION_TOKENS_BUCKETS,
    EngineCoreOutput,
    EngineCoreOutputs,
    SchedulerStats,
)
from shared.messages.steps import (  # noqa: F401
    CachedRequestData,
    EngineCoreRequest,
    FinishReason,
    Logprob,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    RemoteKVLoad,
    SchedulerOutput,
)
