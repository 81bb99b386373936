from __future__ import annotations

from django import template

from catalog.money import per_million, usd

register = template.Library()
register.filter("usd", usd)
register.filter("per_million", per_million)
