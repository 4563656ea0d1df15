"""Optional integrations, detected at run time: each module sets ``AVAILABLE`` and exports the names gradpatch
uses (under graphpatch's module paths, ``gradpatch.optional.transformers`` and so on).

Nothing here is imported by ``import gradpatch``; the engine imports a module the first time it meets a model
that needs it (an accelerate-dispatched model, a bitsandbytes layer).
"""
