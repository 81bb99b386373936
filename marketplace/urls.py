from __future__ import annotations

from django.urls import path

from marketplace import apis

urlpatterns = [
    path("chat/completions", apis.ChatCompletionsApi.as_view()),
    path("chat/completions/<str:public_id>", apis.StreamResumeApi.as_view()),
    path("completions", apis.CompletionsApi.as_view()),
    path("completions/<str:public_id>", apis.StreamResumeApi.as_view()),
    path("embeddings", apis.EmbeddingsApi.as_view()),
    path("models", apis.ModelListApi.as_view()),
    path("credits", apis.CreditsApi.as_view()),
    path("generation", apis.GenerationStatsApi.as_view()),
]
