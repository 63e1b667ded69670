"""The ASGI layer in front of ``POST /v1/responses``: the guard, its intake and the client's writer.

One job per module:

* `guard` — `BudgetMiddleware`: runs the intake, supervises the inner app (deadline, drain,
  disconnect) and settles every outcome once, through `middleware.outcomes`.
* `intake` — `Intake`: the DESIGN.md §3 checks in order, from the raw request to an admitted
  `middleware.loop.context.RequestContext`.
* `client_stream` — `ClientStream`: the one writer to ``send`` (commit flag, sequence numbers,
  coalescing, keep-alives, the failure frames).
* `auth` — `Authenticator`: gateway API keys and the caller's identity (a hash of its key).
* `validate` — `validate_request`: the field checks of a parsed create request.
* `models` — `ModelRouter`: configured model names or patterns to their upstream and limits.

Nothing is re-exported here: import from the module.
"""
