"""Reading server-sent events with requests (raw HTTP, no OpenAI client)."""

import json

import requests


def stream_events(url, body, headers=None, timeout=120):
    """POSTs body and returns (the parsed `data:` objects in order, whether `[DONE]` ended the stream)."""
    h = {"Content-Type": "application/json"}
    h.update(headers or {})
    events, done = [], False
    with requests.post(url, json=body, headers=h, stream=True, timeout=timeout) as r:
        assert r.status_code == 200, r.text
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r.iter_lines(decode_unicode=False):
            if not line:
                continue
            assert line.startswith(b"data: "), line
            payload = line[len(b"data: "):]
            assert not done, "data after [DONE]"
            if payload == b"[DONE]":
                done = True
                continue
            events.append(json.loads(payload.decode("utf-8")))
    return events, done


def joined_text(events, chat, n=1):
    """The streamed text of each choice, in index order."""
    texts = [""] * n
    for e in events:
        for c in e["choices"]:
            if chat:
                texts[c["index"]] += c["delta"].get("content") or ""
            else:
                texts[c["index"]] += c["text"]
    return texts
