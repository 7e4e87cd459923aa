"""The client's put body made as it is sent (kvtier.tiers.remote._PutBody, issue 17): the
same bytes as the frames encoded all at once, its declared length exact, sent again whole when
urllib3 retries (a keep-alive the restarted daemon dropped), and every block stored exactly."""

from __future__ import annotations

import torch

from kvtier.records import encode_header
from kvtier.tiers.remote import RemoteTier, _PutBody
from kvtier.wire import END, block_bytes, frame_prefix
from tests.conftest import random_blocks
from tests.unit.server.conftest import NAMESPACE, SPEC, ThreadDaemon, hashes, serve_settings


def test_the_streamed_body_is_the_frames_and_can_be_sent_twice():
    hs, blocks = hashes(5), list(random_blocks(SPEC, 5))
    fps = [bytes([i]) * 32 for i in range(5)]
    expected = b"".join(frame_prefix(h) + encode_header(NAMESPACE, b, 0, fp) + bytes(block_bytes(b))
                        for h, b, fp in zip(hs, blocks, fps)) + END
    body = _PutBody(NAMESPACE, hs, blocks, fps)
    first, second = b"".join(bytes(p) for p in body), b"".join(bytes(p) for p in body)
    assert first == expected and second == expected and body.nbytes == len(expected)


def test_a_put_after_a_daemon_restart_resends_the_whole_body(tmp_path):
    daemon = ThreadDaemon(serve_settings(tmp_path / "data")).start()
    remote = RemoteTier(daemon.url, timeout_s=5.0)
    try:
        remote.register(NAMESPACE, SPEC)
        blocks = random_blocks(SPEC, 8, seed=7)
        assert remote.put(NAMESPACE, hashes(4), list(blocks[:4])) == [True] * 4
        daemon.stop()
        daemon.start()  # the pooled keep-alive is dead: urllib3 retries on a new connection
        assert remote.put(NAMESPACE, hashes(4, salt=1), list(blocks[4:])) == [True] * 4, dict(remote.errors)
        out = torch.empty_like(blocks)
        got = remote.get_into(NAMESPACE, hashes(4) + hashes(4, salt=1), list(out))
        assert all(s.name == "OK" for s in got), got
        assert torch.equal(out.view(torch.uint8), blocks.view(torch.uint8))
    finally:
        remote.close()
        daemon.stop()
