"""isoserve: multi-tenant LLM inference with disaggregated prefill and decode, where one
tenant's data can never appear in another tenant's response."""
__all__ = ["LLM", "SamplingParams", "CompletionResult"]
__version__ = "0.1.0"


def __getattr__(name):
    # Imported lazily so that `isoserve --help` and the router start without loading torch.
    if name in ("LLM", "CompletionResult"):
        from isoserve.engine import llm
        return getattr(llm, name)
    if name == "SamplingParams":
        from isoserve.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(name)
