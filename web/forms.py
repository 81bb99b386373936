"""Input parsing for the pages. Forms validate shape only; the services decide."""

from __future__ import annotations

from datetime import date
from decimal import Decimal
from typing import Any

from django import forms
from django.conf import settings
from django.contrib.auth import password_validation
from django.contrib.auth.forms import AuthenticationForm, SetPasswordForm
from django.http import QueryDict

from accounts.services import api_key_revoke_all
from billing.services import topup_rule
from catalog.money import UCENTS_PER_USD
from core.dates import DateRangeInvalid, day_range


class SignupForm(forms.Form):
    email = forms.EmailField(label="E-mail", max_length=150)
    password = forms.CharField(label="Password", widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}))

    def clean(self) -> dict:
        """Django's password validators, the address among the attributes it must not resemble."""
        cleaned = super().clean()
        assert cleaned is not None  # (Django's own clean returns cleaned_data)
        password, email = cleaned.get("password"), cleaned.get("email")
        if password:
            from django.contrib.auth.models import User

            try:
                password_validation.validate_password(password, User(username=email or "", email=email or ""))
            except forms.ValidationError as error:
                self.add_error("password", error)
        return cleaned


class NewPasswordForm(SetPasswordForm):
    """The password reset's last step; it also asks whether the account's API keys go too
    (someone who could sign in before the reset may have made keys; every other session
    ends with the old password anyway)."""

    revoke_keys = forms.BooleanField(
        label="Also revoke every API key of this account (recommended if you did not make them all)",
        required=False,
        initial=True,
    )

    def save(self, commit: bool = True) -> Any:
        user = super().save(commit=commit)
        if commit and self.cleaned_data.get("revoke_keys"):
            api_key_revoke_all(user=user)
        return user


class LoginForm(AuthenticationForm):
    """Django's login form with the username labelled as the e-mail it is."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["username"].label = "E-mail"
        self.fields["username"].widget = forms.EmailInput(attrs={"autofocus": True, "autocomplete": "email"})

    def clean_username(self) -> str:
        return self.cleaned_data["username"].strip().lower()


class TopupForm(forms.Form):
    """An amount in USD, in cents. The limits are the service's to decide (`topup_create`); the
    input carries them (min, max) and every refusal of the form states them too."""

    amount_usd = forms.DecimalField(label="Amount (USD)", max_digits=9, decimal_places=2)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        low, high = settings.TOPUP_MIN_CENTS, settings.TOPUP_MAX_CENTS
        rule = topup_rule()
        field = self.fields["amount_usd"]
        field.widget.attrs.update(min=f"{low / 100:.2f}", max=f"{high / 100:.2f}", step="0.01", placeholder="20")
        field.error_messages.update(
            required=f"Enter an amount in USD. {rule}",
            invalid=f"Enter an amount in USD, e.g. 20. {rule}",
            max_digits=rule,
            max_whole_digits=rule,
            max_decimal_places="Enter the amount in whole cents (at most two decimals).",
        )

    @property
    def amount_cents(self) -> int:
        return int(self.cleaned_data["amount_usd"] * 100)


CAP_RULE = "from $0 to $9,999.99999999, exact to the micro-cent (at most 8 decimal places), or empty for no cap"


class ApiKeyForm(forms.Form):
    """Each error states the rule it enforces (not just "Enter a number")."""

    name = forms.CharField(
        label="Name",
        max_length=100,
        required=False,
        help_text="optional, up to 100 characters",
        error_messages={"max_length": "A key's name is at most 100 characters."},
    )
    cap_usd = forms.DecimalField(
        label="Spend cap (USD, optional)",
        required=False,
        min_value=Decimal("0"),
        max_digits=12,
        decimal_places=8,
        help_text=f"what this key may spend in all: {CAP_RULE}",
        error_messages={
            key: f"A spend cap is an amount in US dollars {CAP_RULE}, e.g. 5 or 12.50."
            for key in ("invalid", "min_value", "max_digits", "max_decimal_places", "max_whole_digits")
        },
    )
    trusted_only = forms.BooleanField(
        label="Trusted hosts only (hosts out of probation; requests may wait longer)", required=False
    )
    account_wide = forms.BooleanField(
        label="Account-wide: it may list and resume every request of the account, not only its own "
        "(for a dashboard or a server; leave it off for a key shipped inside a client)",
        required=False,
    )

    @property
    def spend_cap_ucents(self) -> int | None:
        cap = self.cleaned_data.get("cap_usd")
        return None if cap is None else int(cap * UCENTS_PER_USD)


class HostForm(forms.Form):
    name = forms.CharField(
        label="Machine name",
        max_length=100,
        help_text="up to 100 characters, e.g. desk",
        error_messages={
            "required": "Give the machine a name (up to 100 characters), e.g. desk.",
            "max_length": "A machine's name is at most 100 characters.",
        },
    )


class PayoutForm(forms.Form):
    amount_usd = forms.DecimalField(
        label="Amount (USD, empty = everything available)",
        required=False,
        min_value=Decimal("0.01"),
        max_digits=12,
        decimal_places=2,
    )

    @property
    def amount_ucents(self) -> int | None:
        amount = self.cleaned_data.get("amount_usd")
        return None if amount is None else int(amount * UCENTS_PER_USD)


class DateRangeForm(forms.Form):
    """`from` / `to` (inclusive UTC days); the last 30 days when absent."""

    start = forms.DateField(required=False, label="From", error_messages={"invalid": "Enter a date as YYYY-MM-DD."})
    end = forms.DateField(required=False, label="To", error_messages={"invalid": "Enter a date as YYYY-MM-DD."})

    def __init__(self, query: QueryDict, *args: Any, **kwargs: Any) -> None:
        super().__init__({"start": query.get("from", ""), "end": query.get("to", "")}, *args, **kwargs)

    def clean(self) -> dict:
        data = super().clean() or {}
        try:
            data["start"], data["end"] = day_range(data.get("start"), data.get("end"))
        except DateRangeInvalid as error:
            raise forms.ValidationError(error.message) from None
        return data

    def range(self) -> tuple[date, date]:
        """The valid range, or the default 30 days when the query was malformed."""
        if self.is_valid():
            return self.cleaned_data["start"], self.cleaned_data["end"]
        return day_range(None, None)
