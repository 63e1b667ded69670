"""Development stand-ins: nothing here is on the request path of a configured gateway.

One job per module:

* `devmodel` — `create_devmodel_app`: the embedded, scripted Responses API model server.
* `devchat` — its `/v1/chat/completions`: the same answers in the Chat Completions shape.
* `demo_tools` — `create_demo_server`: the in-process demo MCP server (``get_time``, ``calculate``).
* `embedded` — `BackgroundServer`: uvicorn in a background thread on a loopback port.

Nothing is re-exported here: import from the module.
"""
