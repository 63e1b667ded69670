"""Chat Completions upstreams (issue 25): one Responses round as one ``/v1/chat/completions`` call.

One job per module:

* `dialect` — `ChatDialect`: the upstream's dialect settings and the translator's caps.
* `request` — `translate_request`: the round's Responses body as a Chat request.
* `response` — `Completion`, `build_response`, `completion_from_body`: the finite builder.
* `stream` — `StreamConverter`: Chat SSE chunks as Responses SSE events.
* `errors` — the translation failures and ``loopwarden_translation_failures_total``.
* `client` — `ChatUpstream` / `ChatResponse`: the `UpstreamClient` the loop calls, and
  `bind_ledger`.

Reference: ../shared/specs/chat-completions-translation.md (DESIGN.md wins where they differ).
"""

from middleware.upstream.chat.client import ChatUpstream, bind_ledger
from middleware.upstream.chat.dialect import ChatDialect

__all__ = ["ChatDialect", "ChatUpstream", "bind_ledger"]
