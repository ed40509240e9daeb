"""The front ends' formats: every translation between an API's JSON and the engine's typed
values (`GenerationRequest` in, `GenerationResult` and `Chunk`s out), one module per format.

    pipe_format         the JSONL pipe's request, result and error (also /v1/cluster/generate)
    openai_chat         OpenAI chat completions
    completions         OpenAI completions
    anthropic_messages  Anthropic Messages
    responses_api       OpenAI's Responses API
    chat_messages       OpenAI chat's messages, tools and tool_choice (the pipe's and
                        llama-server's too), and the checks every API's chat goes through
    tool_specs          function tools and their JSON Schemas, checked for every API
    body_fields         the field checks every body shares, and FormatError
    result_extras       our `timing` and `speculation` objects beside every API's own fields

Imports only the engine's value types (engine/request.py, results.py, json_types.py): no mlx,
no HTTP. A body is read once, into the request; the API routes (skulkp2p/api/), the pipe, the
served engine's client and the bench use these.
"""
