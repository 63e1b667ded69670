"""Serving one ``POST /v1/responses`` behind the guard: the decision, the loop and its pieces.

One job per module:

* `app` — `ResponsesApp`: picks the path of a request (the agent loop or the pass-through).
* `decision` — `classify_round`: the pure step from a round's outcome to a `LoopDecision`.
* `agent` — `AgentLoop`: the server-side tool loop (rounds, gateway tool calls, one answer).
* `stitcher` — `StreamStitcher`: every round's SSE events as one logical client stream.
* `passthrough` — `Passthrough`: one stateless round forwarded under the ledger.
* `items` — pure builders of client-visible items and events (``mcp_call``, usage, terminal events).
* `echo` — `normalise_response`: the echo fields an upstream omitted, filled from the request.
* `approvals` — `pending_approvals`, `check_call_pairs`: new input settled against the history.
* `context` — `RequestContext`: the admitted request as the intake hands it to the loop.
* `background` — `BackgroundTasks`: ``background: true`` responses as tasks (heartbeat, cancel, drain).
* `supervise` — `Supervisor`: a background task's deadline, drain and cancel; `serve_follower`.
* `eventlog` — `EventLog`: a streamed background response's SSE frames (a bounded window); `follow`.
* `resume` — ``GET /v1/responses/{id}?stream=true&starting_after=N``.

Nothing is re-exported here: import from the module.
"""
