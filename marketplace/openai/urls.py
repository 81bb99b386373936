from __future__ import annotations

from django.urls import path

from core.openapi import documented
from marketplace.openai import apis

urlpatterns = [
    path("chat/completions", documented(apis.ChatCompletionsApi)),
    path("chat/completions/<str:public_id>", documented(apis.StreamResumeApi)),
    path("completions", documented(apis.CompletionsApi)),
    path("completions/<str:public_id>", documented(apis.StreamResumeApi)),
    path("embeddings", documented(apis.EmbeddingsApi)),
    path("models", apis.ModelListApi.as_view()),
    path("models/<path:model_id>", apis.ModelApi.as_view()),
    path("responses", documented(apis.ResponsesApi)),
    path("responses/<str:response_id>", apis.StoredResponseApi.as_view()),
    path("credits", apis.CreditsApi.as_view()),
    path("generation", apis.GenerationStatsApi.as_view()),
]
