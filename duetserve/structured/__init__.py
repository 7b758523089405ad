"""Structured output: constrained decoding with llguidance (layer 1, no torch).

    grammars.py     GuidedDecoding -> llguidance grammar text (JSON schema, regex, choice,
                    Lark, tool calls), validated; errors name the request field
    compiler.py     GrammarCompiler (compile once per spec, LRU cache, thread-safe) and
                    GrammarState (one request's matcher: mask, accept, rollback)
    spelling.py     what the vocabulary can write: refuses constraints it cannot, repairs
                    the mask rows llguidance gets wrong when some bytes have no token
    tool_syntax.py  the tool-call syntax (<tool_call>{json}</tool_call>) and its parser

The worker applies the masks to the logits (worker/grammar_mask.py); the engine owns the
compiler and checks constraints at admission; the server compiles off the event loop.
"""
from duetserve.structured.compiler import (ConstraintError, GrammarCompiler, GrammarError,
                                           GrammarState)

__all__ = ["ConstraintError", "GrammarCompiler", "GrammarError", "GrammarState"]
