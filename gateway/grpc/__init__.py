"""The gRPC ingress: KServe v2 / Triton `inference.GRPCInferenceService` under the HTTP path's admission.

A call is classified from its metadata as an HTTP request is from its headers, translated to the
KServe HTTP binary tensor extension (byte for byte), and admitted through the same admitted call
(gateway.flow.admitted), so HTTP and gRPC clients share one queue and one count of slots.
"""
