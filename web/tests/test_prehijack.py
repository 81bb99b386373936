"""Accounts cannot be taken before they exist (issue 30), written as the attack: sign up with the
victim's address, try to make a key and a machine, wait for the victim to sign up and confirm,
then try to get in. The attacker is left with nothing; a confirmation link works once, only
with its sign-up's password, and only while it is the latest."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core import mail, signing
from django.test import Client
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import AccountUnconfirmed, api_key_create
from hosts.models import Host
from hosts.services import host_create
from web.services import VERIFY_MAX_AGE_SECONDS, email_unverified

pytestmark = pytest.mark.django_db

VICTIM = "victim@corp.example"
ATTACKER_PASSWORD = "attacker chose this one"
VICTIM_PASSWORD = "the victim's own secret"


def signed_in(email: str, password: str) -> Client:
    client = Client()
    client.post("/login/", {"username": email, "password": password})
    return client


def links_to(email: str) -> list[str]:
    return [
        re.search(r"http://testserver(/verify/\S+/)", m.body).group(1)
        for m in mail.outbox
        if m.to == [email] and "/verify/" in m.body
    ]


class PreHijackTests:
    def test_the_attacker_who_signed_up_first_is_left_with_nothing(self, catalog) -> None:
        Client().post("/signup/", {"email": VICTIM, "password": ATTACKER_PASSWORD})
        attacker = signed_in(VICTIM, ATTACKER_PASSWORD)
        assert attacker.get("/keys/").status_code == 200  # pages only
        made = attacker.post("/keys/", {"name": "mine"})
        assert "Confirm your e-mail address first" in made.content.decode() and not ApiKey.objects.exists()
        registered = attacker.post("/machines/", {"name": "rig"})
        assert "Confirm your e-mail address first" in registered.content.decode() and not Host.objects.exists()
        attackers_link = links_to(VICTIM)[-1]

        Client().post("/signup/", {"email": VICTIM, "password": VICTIM_PASSWORD})  # the real owner, later
        assert attacker.get("/keys/").status_code == 302, "the attacker's session ended with the password it chose"
        assert signed_in(VICTIM, ATTACKER_PASSWORD).get("/keys/").status_code == 302, "that password no longer signs in"
        assert Client().post(attackers_link, {"password": ATTACKER_PASSWORD}).status_code == 400, "its link is dead"

        victim = Client()
        assert victim.post(links_to(VICTIM)[-1], {"password": VICTIM_PASSWORD}).status_code == 302
        user = get_user_model().objects.get(username=VICTIM)
        assert not email_unverified(user) and victim.get("/keys/").status_code == 200
        assert (
            victim.post("/keys/", {"name": "laptop"}).status_code == 200
            and ApiKey.objects.filter(user=user).count() == 1
        )

    def test_a_link_sent_for_the_attackers_sign_up_cannot_be_confirmed_with_the_victims_password(self, catalog) -> None:
        Client().post("/signup/", {"email": VICTIM, "password": VICTIM_PASSWORD})
        Client().post("/signup/", {"email": VICTIM, "password": ATTACKER_PASSWORD})  # the attacker, after the owner
        victims_link, attackers_link = links_to(VICTIM)
        assert (
            Client().post(victims_link, {"password": VICTIM_PASSWORD}).status_code == 400
        )  # replaced by the newer one
        refused = Client().post(attackers_link, {"password": VICTIM_PASSWORD})
        assert refused.status_code == 400 and "not the password chosen" in refused.content.decode()
        assert email_unverified(get_user_model().objects.get(username=VICTIM)), "nobody confirmed anything"

    def test_a_used_link_signs_nobody_in(self, catalog) -> None:
        Client().post("/signup/", {"email": VICTIM, "password": VICTIM_PASSWORD})
        (link,) = links_to(VICTIM)
        assert Client().post(link, {"password": VICTIM_PASSWORD}).status_code == 302
        again = Client()
        answer = again.post(link, {"password": VICTIM_PASSWORD})
        assert answer.status_code == 400 and "used already" in answer.content.decode()
        assert again.get("/keys/").status_code == 302, "not signed in"

    def test_a_link_expires_after_two_hours(self, catalog, monkeypatch) -> None:
        Client().post("/signup/", {"email": VICTIM, "password": VICTIM_PASSWORD})
        (link,) = links_to(VICTIM)
        later = timezone.now().timestamp() + VERIFY_MAX_AGE_SECONDS + 1
        monkeypatch.setattr(signing.time, "time", lambda: later)
        answer = Client().post(link, {"password": VICTIM_PASSWORD})
        assert answer.status_code == 400 and "expired" in answer.content.decode()
        assert VERIFY_MAX_AGE_SECONDS == timedelta(hours=2).total_seconds()

    def test_the_services_refuse_an_unconfirmed_account_too(self, catalog) -> None:
        Client().post("/signup/", {"email": VICTIM, "password": ATTACKER_PASSWORD})
        user = get_user_model().objects.get(username=VICTIM)
        with pytest.raises(AccountUnconfirmed):
            api_key_create(user=user, name="script")
        with pytest.raises(AccountUnconfirmed):
            host_create(email=VICTIM, name="rig")
        assert (
            host_create(email="operator-made@example.com", name="rig").host.owner.username
            == "operator-made@example.com"
        )
