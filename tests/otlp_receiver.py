"""An OTLP/gRPC trace endpoint for tests and benchmarks: keeps every span it is sent."""

import concurrent.futures
import threading
import time

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from kvmesh.services.launcher import free_port


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace endpoint that keeps every span with its service name."""

    def __init__(self):
        self.spans = []  # (service name, span)
        self.lock = threading.Lock()
        self.port = free_port()
        self.server = grpc.server(concurrent.futures.ThreadPoolExecutor(4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    @property
    def env(self) -> dict[str, str]:
        """Environment for services that export their spans here, in batches every 200 ms."""
        return {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{self.port}", "OTEL_EXPORTER_OTLP_INSECURE": "true",
                "OTEL_BSP_SCHEDULE_DELAY": "200"}

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope in resource_spans.scope_spans:
                    self.spans.extend((attrs.get("service.name"), s) for s in scope.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: bytes):
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]

    def linked_forwards(self, trace_id: bytes):
        """`kvmesh.forward` spans (each in a trace of its own) that link to a span of `trace_id`."""
        with self.lock:
            return [s for _, s in self.spans if s.name == "kvmesh.forward"
                    and any(link.trace_id == trace_id for link in s.links)]

    def wait_for(self, trace_id: bytes, until, timeout=20):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.trace(trace_id)
            if until(spans):
                return spans
            time.sleep(0.2)
        return self.trace(trace_id)
