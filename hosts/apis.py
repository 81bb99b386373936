"""The host API's own part: a host reads the catalog's files and registers the models it
benchmarked on its machine.

The job endpoints (claim, tokens, complete, fail), heartbeat, `me` and earnings are
the marketplace's (`marketplace/hostdoor/host_apis.py`): they read and write jobs.
"""

from __future__ import annotations

from drf_spectacular.utils import extend_schema
from rest_framework import serializers
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from catalog.selectors import catalog_models
from core.errors import ApiError
from core.http import INT_MAX, bearer_secret, holds_nul
from core.openapi import ERROR, HOST_TOKEN
from hosts import services
from hosts.models import Host
from hosts.selectors import host_from_secret


class HostApi(APIView):
    security_scheme = HOST_TOKEN

    def host(self, request: Request) -> Host:
        return host_from_secret(bearer_secret(request))


class QualificationRegisterApi(HostApi):
    class InputSerializer(serializers.Serializer):
        class BenchmarkSerializer(serializers.Serializer):
            prompt_tps = serializers.FloatField(min_value=0)
            gen_tps = serializers.FloatField(min_value=0.001)
            ttft_ms = serializers.FloatField(min_value=0)
            load_ms = serializers.FloatField(min_value=0, required=False, default=0)
            memory_mb = serializers.FloatField(min_value=0)
            threads = serializers.IntegerField(min_value=0, max_value=INT_MAX, required=False, default=0)
            device = serializers.CharField(
                max_length=100, required=False, default="cpu", help_text='"cpu" or the GPU\'s name'
            )
            gpu_layers = serializers.IntegerField(min_value=0, max_value=10_000, required=False, default=0)
            vram_mb = serializers.FloatField(min_value=0, required=False, default=0)

        model = serializers.CharField(max_length=100)
        fingerprint = serializers.CharField(max_length=64)
        benchmark = BenchmarkSerializer()
        machine = serializers.DictField(required=False, default=dict)
        sha256 = serializers.RegexField(
            r"^[0-9a-fA-F]{64}$", required=False, default="", help_text="the sha256 of the weights file benchmarked"
        )

        def validate_machine(self, machine: dict) -> dict:
            if holds_nul(machine):  # stored as JSON, which the database cannot hold with one
                raise serializers.ValidationError("Null characters are not allowed.")
            return machine

    class OutputSerializer(serializers.Serializer):
        model = serializers.CharField()
        fingerprint = serializers.CharField()

    @extend_schema(responses={201: OutputSerializer, 404: ERROR, 409: ERROR})
    def post(self, request: Request) -> Response:
        host = self.host(request)
        serializer = self.InputSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        try:
            services.qualification_register(
                host=host,
                model_name=data["model"],
                fingerprint=data["fingerprint"],
                benchmark=data["benchmark"],
                machine=data["machine"],
                sha256=data["sha256"],
            )
        except services.UnknownModel as error:
            raise ApiError(404, str(error), code="model_not_found", param="model") from None
        except services.WrongModelFile as error:
            raise ApiError(409, str(error), code="model_file_mismatch", param="sha256") from None
        return Response({"model": data["model"], "fingerprint": data["fingerprint"]}, status=201)


class CatalogListApi(HostApi):
    """The files the catalog sells, for a host to tell whether one it holds is among them
    (`mahout add` hashes the file and looks its sha256 up here)."""

    class OutputSerializer(serializers.Serializer):
        class EntrySerializer(serializers.Serializer):
            name = serializers.CharField()
            kind = serializers.CharField(help_text='"chat" or "embedding"')
            sha256 = serializers.CharField(help_text="the one weights file the catalog means by this name (blank: any)")
            quantization = serializers.CharField(help_text="e.g. Q4_K_M (blank where unknown)")
            file_size = serializers.IntegerField(allow_null=True, help_text="bytes of the weights file")
            context_length = serializers.IntegerField(help_text="the context sold, in tokens")
            embedding_dimensions = serializers.IntegerField(
                allow_null=True, help_text="an embeddings model's vector width"
            )

        models = EntrySerializer(many=True)

    @extend_schema(responses={200: OutputSerializer})
    def get(self, request: Request) -> Response:
        self.host(request)
        return Response(self.OutputSerializer({"models": catalog_models()}).data)
