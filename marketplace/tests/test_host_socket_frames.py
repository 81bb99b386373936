"""The host socket's `tokens` frame, in process (channels' communicator): bounded as the HTTP
route's body and path are, so one host's frame cannot break the trip that carries every
host's batches (`marketplace.hostdoor.pushing`)."""

from __future__ import annotations

import asyncio

import pytest
from channels.testing import WebsocketCommunicator

from conftest import make_host
from core.errors import DomainError
from marketplace.models import Job, Request
from marketplace.tests.test_pushing import BATCH, roomy
from marketplace.tests.test_services import claimed

pytestmark = pytest.mark.django_db(transaction=True)  # the consumer's queries run on core.db's threads


def socket(token: str) -> WebsocketCommunicator:
    from config.asgi import application

    return WebsocketCommunicator(application, "/hosts/ws", headers=[(b"authorization", f"Bearer {token}".encode())])


async def answers_of(honest_token: str, cheat_token: str, honest_frame: dict, cheat_frame: dict) -> tuple[dict, dict]:
    """Both frames sent at once, beside each other; each socket's answer."""
    honest, cheat = socket(honest_token), socket(cheat_token)
    try:
        assert (await honest.connect(timeout=10))[0] and (await cheat.connect(timeout=10))[0]
        await cheat.send_json_to(cheat_frame)
        await honest.send_json_to(honest_frame)
        return await honest.receive_json_from(timeout=10), await cheat.receive_json_from(timeout=10)
    finally:
        await asyncio.gather(honest.disconnect(), cheat.disconnect())


class TokensFrameBoundsTests:
    @pytest.mark.parametrize(("field", "value"), [("seq", 2**31), ("seq", 2**63), ("job", 2**63), ("seq", -1)])
    def test_a_frame_past_the_http_bounds_is_refused_and_the_honest_stream_beside_it_arrives(
        self, customer, catalog, settings, field: str, value: int
    ) -> None:
        settings.HOST_RECONNECT_GRACE_SECONDS = 0
        honest, cheat = roomy(make_host(name="honest")), roomy(make_host(name="cheat"))
        request, job = claimed(customer, honest, catalog)
        _, own = claimed(customer, cheat, catalog)
        bad = {"type": "tokens", "job": own.pk, "seq": 0, "text": "x", field: value}
        ack, refusal = asyncio.run(
            answers_of(honest.token, cheat.token, {"type": "tokens", "job": job.pk, "seq": 0, "text": BATCH}, bad)
        )
        assert ack == {"type": "ack", "job": job.pk, "seq": 0, "accepted": True, "next_seq": 1}
        assert Request.objects.get(pk=request.pk).delivered_text == BATCH
        assert (refusal["type"], refusal["status"], refusal["code"]) == ("error", 400, "invalid_value")
        assert refusal["message"].startswith(f"'{field}': ") and (refusal["job"], refusal["seq"]) == (
            bad["job"],
            bad["seq"],
        )
        assert Job.objects.get(pk=own.pk).next_seq == 0

    @pytest.mark.parametrize(
        ("frame", "param"),
        [
            ({"seq": 0, "text": "x" * 65537}, "text"),
            ({"seq": 0, "text": "x", "finish_reason": "eos"}, "finish_reason"),
            ({"seq": True, "text": "x"}, "seq"),
            ({"seq": 0}, "text"),
            ({"seq": 0, "text": "x", "logprobs": {"a": 1}}, "logprobs"),
        ],
    )
    def test_every_field_is_checked_as_the_http_route_checks_it(
        self, customer, catalog, settings, frame: dict, param: str
    ) -> None:
        from marketplace.hostdoor.consumers import tokens_frame
        from marketplace.hostdoor.host_apis import JobTokensApi

        assert not JobTokensApi.InputSerializer(data=frame).is_valid()  # the HTTP body refuses it too
        with pytest.raises(DomainError) as refused:
            tokens_frame({"type": "tokens", "job": 1, **frame})
        assert (refused.value.status, refused.value.param) == (400, param)

    def test_a_frame_within_the_bounds_is_read_as_the_http_body_is(self) -> None:
        from marketplace.hostdoor.consumers import tokens_frame

        assert tokens_frame(
            {"type": "tokens", "job": 10**18 - 1, "seq": 2**31 - 1, "text": "a\x00b", "finish_reason": "stop"}
        ) == {"job_id": 10**18 - 1, "seq": 2**31 - 1, "text": "a\x00b", "finish_reason": "stop"}
