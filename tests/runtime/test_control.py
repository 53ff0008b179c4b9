from ember.runtime import control


def test_ready_and_failed_travel_as_one_json_line_each():
    ready = control.Ready(port=4242, started=12.5, timings={"import_ms": 30, "weights": "snapshot"}, control_secret="s")
    line = control.encode(ready)
    assert "\n" not in line and '"event": "ready"' in line
    assert control.decode(line.encode()) == ready
    failed = control.Failed("enter", "RuntimeError: no weights")
    assert control.decode(control.encode(failed)) == failed


def test_what_is_not_a_control_message_decodes_to_none():
    for line in (b"", b"Traceback (most recent call last):", b'{"event": "hello"}', b'{"event": "ready"}', b"[1]"):
        assert control.decode(line) is None
