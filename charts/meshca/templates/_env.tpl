{{/*
The environment of the meshca container, from the values. extraEnv may not repeat a name set
here (a duplicate name fails server-side apply, and which one wins is not obvious): the
Deployment refuses it.
*/}}
{{- define "meshca.env" }}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: ROOT_CA_DIR
  value: /etc/cacerts
- name: MESHCA_SIGNER
  value: {{ .Values.signer.uri | quote }}
- name: MESHCA_SIGNER_ALLOW_SHARED_KEY_FILE
  value: {{ .Values.signer.allowSharedKeyFile | quote }}
- name: MESHCA_PKCS11_SESSIONS
  value: {{ .Values.signer.pkcs11.sessions | quote }}
- name: MESHCA_ISSUING_CA
  value: {{ .Values.signer.issuingCa | quote }}
- name: MESHCA_ISSUING_CA_TTL
  value: {{ .Values.signer.issuingCaTtl | quote }}
- name: TRUST_DOMAIN
  value: {{ .Values.trustDomain | quote }}
- name: TRUST_DOMAIN_ALIASES
  value: {{ join "," .Values.trustDomainAliases | quote }}
- name: DEFAULT_WORKLOAD_CERT_TTL
  value: {{ .Values.certificates.defaultTTL | quote }}
- name: MAX_WORKLOAD_CERT_TTL
  value: {{ .Values.certificates.maxTTL | quote }}
- name: MESHCA_CSR_POLICY
  value: {{ .Values.certificates.csrPolicy | quote }}
- name: CA_TRUSTED_NODE_ACCOUNTS
  value: {{ join "," .Values.trustedNodeAccounts | quote }}
- name: TOKEN_AUDIENCES
  value: {{ join "," .Values.tokenAudiences | quote }}
- name: CLUSTER_ID
  value: {{ .Values.clusterID | quote }}
- name: MESHCA_MTLS_IMPERSONATION
  value: {{ .Values.mtlsImpersonation | quote }}
- name: ISTIO_MULTIROOT_MESH
  value: {{ .Values.multiRoot | quote }}
- name: MESHCA_SERVING_NAMES
  value: {{ include "meshca.servingNames" . | quote }}
- name: MESHCA_LISTEN
  value: "0.0.0.0:15012"
- name: MESHCA_ADMIN_LISTEN
  value: "0.0.0.0:15014"
- name: MESHCA_TOKEN_CACHE_TTL
  value: {{ .Values.tokenReview.cacheTTL | quote }}
- name: MESHCA_TOKENREVIEW_TIMEOUT
  value: {{ .Values.tokenReview.timeout | quote }}
- name: MESHCA_RELOAD_POLL
  value: {{ .Values.reloadPoll | quote }}
{{- if .Values.rotation.enabled }}
- name: MESHCA_ROTATION_NEXT_DIR
  value: /etc/cacerts-next
- name: MESHCA_ROTATION_STATE
  value: /var/lib/meshca-rotation/rotation-state.json
- name: MESHCA_ROTATION_MARK_SLACK
  value: {{ .Values.rotation.markSlack | quote }}
{{- end }}
- name: LOG_FORMAT
  value: {{ .Values.logging.format | quote }}
- name: RUST_LOG
  value: {{ .Values.logging.level | quote }}
- name: MESHCA_AUDIT_SINK
  value: {{ .Values.audit.sink | quote }}
- name: MESHCA_AUDIT_FILE
  value: {{ .Values.audit.file.path | quote }}
- name: MESHCA_AUDIT_MAX_BYTES
  value: {{ .Values.audit.file.maxBytes | int64 | quote }}
- name: MESHCA_AUDIT_MAX_FILES
  value: {{ .Values.audit.file.maxFiles | int64 | quote }}
- name: MESHCA_AUDIT_RETAIN_ISSUED
  value: {{ .Values.audit.file.retainIssued | quote }}
{{- with (include "meshca.checkpointSecret" .) }}
- name: MESHCA_AUDIT_CHECKPOINT_KEY
  value: {{ printf "%s/%s" (include "meshca.checkpointKeyDir" $) $.Values.audit.checkpoint.secretKey | quote }}
{{- end }}
{{- with (include "meshca.generatedKeySecret" .) }}
# Created by meshca with a new key on its first start, read back on every later one.
- name: MESHCA_AUDIT_CHECKPOINT_KEY_SECRET
  value: {{ printf "%s/%s" $.Release.Namespace . | quote }}
{{- end }}
- name: MESHCA_AUDIT_CHECKPOINT_EVERY
  value: {{ .Values.audit.checkpoint.every | int64 | quote }}
- name: MESHCA_AUDIT_CHECKPOINT_INTERVAL
  value: {{ .Values.audit.checkpoint.interval | quote }}
- name: MESHCA_PUBLISH_ROOT
  value: {{ .Values.rootPublisher.enabled | quote }}
{{- with .Values.rootPublisher.namespaceSelector }}
- name: MESHCA_PUBLISH_ROOT_NAMESPACE_SELECTOR
  value: {{ . | quote }}
{{- end }}
- name: PILOT_CA_CERT_CONFIGMAP
  value: {{ .Values.rootPublisher.configMapName | quote }}
- name: MESHCA_PUBLISH_ROOT_RESYNC
  value: {{ .Values.rootPublisher.resync | quote }}
- name: MESHCA_MTLS_RENEWAL_POD_CHECK
  value: {{ .Values.killSwitch.renewalPodCheck | quote }}
{{- with .Values.killSwitch.renewalMaxTTL }}
- name: MESHCA_MTLS_RENEWAL_MAX_TTL
  value: {{ . | quote }}
{{- end }}
- name: MESHCA_POD_INDEX_MAX_STALENESS
  value: {{ .Values.killSwitch.podIndexMaxStaleness | quote }}
- name: MESHCA_POD_INDEX_SYNC_WAIT
  value: {{ .Values.coldStart.podIndexSyncWait | quote }}
{{- with .Values.killSwitch.denylist.configMapName }}
- name: MESHCA_DENYLIST_CONFIGMAP
  value: {{ printf "%s/%s" $.Release.Namespace . | quote }}
{{- end }}
- name: MESHCA_DENYLIST_POLL
  value: {{ .Values.killSwitch.denylist.poll | quote }}
{{- if .Values.killSwitch.revocation.enabled }}
- name: MESHCA_DENYLIST_FILE
  value: "/var/lib/meshca/denylist"
# Shared by every replica; meshca only reads it.
- name: MESHCA_REVOCATION_CONFIGMAP
  value: {{ printf "%s/%s" .Release.Namespace .Values.killSwitch.revocation.configMapName | quote }}
{{- end }}
- name: MESHCA_REVOCATION_POLL
  value: {{ .Values.killSwitch.revocation.poll | quote }}
- name: MESHCA_CRL_VALIDITY
  value: {{ .Values.killSwitch.revocation.crlValidity | quote }}
- name: MESHCA_PUBLISH_CRL
  value: {{ and .Values.killSwitch.revocation.enabled .Values.killSwitch.revocation.publish | quote }}
{{- with .Values.podCertificates.signerName }}
- name: MESHCA_POD_CERTIFICATE_SIGNER
  value: {{ . | quote }}
{{- end }}
- name: MESHCA_POD_CERTIFICATE_LIFETIME
  value: {{ .Values.podCertificates.lifetime | quote }}
- name: MESHCA_POD_CERTIFICATE_REFRESH_BAND
  value: {{ .Values.podCertificates.refreshBand | quote }}
- name: MESHCA_POD_CERTIFICATE_POD_WAIT
  value: {{ .Values.podCertificates.podWait | quote }}
- name: MESHCA_POD_CERTIFICATE_WORKERS
  value: {{ .Values.podCertificates.workers | int64 | quote }}
- name: MESHCA_POD_CERTIFICATE_TRUST_BUNDLE
  value: {{ .Values.podCertificates.trustBundle | quote }}
- name: MESHCA_PUBLISH_CLUSTER_TRUST_BUNDLE
  value: {{ .Values.clusterTrustBundle.enabled | quote }}
- name: MESHCA_CLUSTER_TRUST_BUNDLE_SIGNER
  value: {{ .Values.clusterTrustBundle.signerName | quote }}
- name: MESHCA_CLUSTER_TRUST_BUNDLE_NAME
  value: {{ .Values.clusterTrustBundle.name | quote }}
- name: MESHCA_LIFETIME_JITTER
  value: {{ .Values.certificates.lifetimeJitter | quote }}
- name: MESHCA_LIFETIME_JITTER_BAND
  value: {{ .Values.certificates.lifetimeJitterBand | quote }}
- name: MESHCA_TOKENREVIEW_QPS
  value: {{ .Values.tokenReview.qps | int64 | quote }}
- name: MESHCA_TOKENREVIEW_BURST
  value: {{ .Values.tokenReview.burst | int64 | quote }}
- name: MESHCA_TOKENREVIEW_MAX_INFLIGHT
  value: {{ .Values.tokenReview.maxInflight | int64 | quote }}
- name: MESHCA_TOKENREVIEW_MAX_WAIT
  value: {{ .Values.tokenReview.maxWait | quote }}
- name: MESHCA_TOKEN_NEGATIVE_CACHE_TTL
  value: {{ .Values.tokenReview.negativeCacheTTL | quote }}
- name: MESHCA_TOKEN_NEGATIVE_CACHE_SIZE
  value: {{ .Values.tokenReview.negativeCacheSize | int64 | quote }}
- name: MESHCA_TOKEN_VERIFICATION
  value: {{ .Values.tokenVerification.mode | quote }}
- name: MESHCA_TOKEN_REQUIRE_POD_BINDING
  value: {{ .Values.tokenVerification.requirePodBinding | quote }}
- name: MESHCA_JWKS_REFRESH_INTERVAL
  value: {{ .Values.tokenVerification.jwksRefreshInterval | quote }}
- name: MESHCA_JWKS_MIN_REFRESH_INTERVAL
  value: {{ .Values.tokenVerification.jwksMinRefreshInterval | quote }}
- name: MESHCA_JWKS_MAX_AGE
  value: {{ .Values.tokenVerification.jwksMaxAge | quote }}
- name: MESHCA_REMOTE_SECRETS
  value: {{ .Values.multiCluster.remoteSecrets | quote }}
- name: MESHCA_REMOTE_SECRETS_NAMESPACE
  value: {{ .Release.Namespace | quote }}
- name: PILOT_INSECURE_MULTICLUSTER_KUBECONFIG_OPTIONS
  value: {{ .Values.multiCluster.kubeconfigOptions | quote }}
- name: MESHCA_REMOTE_CLUSTERS_MAX
  value: {{ .Values.multiCluster.maxRemoteClusters | int64 | quote }}
- name: MESHCA_REMOTE_CLUSTER_SYNC_TIMEOUT
  value: {{ .Values.multiCluster.syncTimeout | quote }}
- name: MESHCA_AUDIT_MAX_LINE_BYTES
  value: {{ .Values.audit.maxLineBytes | int64 | quote }}
- name: MESHCA_AUDIT_FSYNC
  value: {{ .Values.audit.fsync | quote }}
- name: MESHCA_AUDIT_FSYNC_BATCH_INTERVAL
  value: {{ .Values.audit.fsyncBatchInterval | quote }}
- name: MESHCA_AUDIT_QUEUE
  value: {{ .Values.audit.queue | int64 | quote }}
- name: MESHCA_AUDIT_UNAUTHENTICATED_RATE
  value: {{ .Values.audit.unauthenticatedRate | int64 | quote }}
- name: MESHCA_AUDIT_HANDSHAKE_INTERVAL
  value: {{ .Values.audit.handshakeInterval | quote }}
- name: MESHCA_AUDIT_HANDSHAKE_MAX_SOURCES
  value: {{ .Values.audit.handshakeMaxSources | int64 | quote }}
- name: MESHCA_AUDIT_AGGREGATE_INTERVAL
  value: {{ .Values.audit.aggregateInterval | quote }}
- name: MESHCA_AUDIT_AGGREGATE_MAX_KEYS
  value: {{ .Values.audit.aggregateMaxKeys | int64 | quote }}
- name: MESHCA_AUDIT_ANCHOR
  value: {{ .Values.audit.anchor.enabled | quote }}
- name: MESHCA_AUDIT_ANCHOR_NAMESPACE
  value: {{ .Release.Namespace | quote }}
- name: MESHCA_AUDIT_ANCHOR_CONFIGMAP
  value: {{ include "meshca.anchorConfigMap" . | quote }}
- name: MESHCA_AUDIT_ANCHOR_INTERVAL
  value: {{ .Values.audit.anchor.interval | quote }}
- name: MESHCA_MAX_CONNECTIONS
  value: {{ .Values.limits.grpc.maxConnections | int64 | quote }}
- name: MESHCA_MAX_CONNECTIONS_PER_IP
  value: {{ .Values.limits.grpc.maxConnectionsPerIP | int64 | quote }}
- name: MESHCA_MAX_PENDING_HANDSHAKES
  value: {{ .Values.limits.grpc.maxPendingHandshakes | int64 | quote }}
- name: MESHCA_HANDSHAKE_TIMEOUT
  value: {{ .Values.limits.grpc.handshakeTimeout | quote }}
- name: MESHCA_MAX_CONCURRENT_STREAMS
  value: {{ .Values.limits.grpc.maxConcurrentStreams | int64 | quote }}
- name: MESHCA_MAX_INFLIGHT_REQUESTS
  value: {{ .Values.limits.grpc.maxInflightRequests | int64 | quote }}
- name: MESHCA_MAX_QUEUED_REQUESTS
  value: {{ .Values.limits.grpc.maxQueuedRequests | int64 | quote }}
- name: MESHCA_REQUEST_TIMEOUT
  value: {{ .Values.limits.grpc.requestTimeout | quote }}
- name: MESHCA_MAX_HEADER_LIST_BYTES
  value: {{ .Values.limits.grpc.maxHeaderListBytes | int64 | quote }}
- name: MESHCA_HTTP2_STREAM_WINDOW_BYTES
  value: {{ .Values.limits.grpc.http2StreamWindowBytes | int64 | quote }}
- name: MESHCA_HTTP2_CONNECTION_WINDOW_BYTES
  value: {{ .Values.limits.grpc.http2ConnectionWindowBytes | int64 | quote }}
- name: MESHCA_KEEPALIVE_INTERVAL
  value: {{ .Values.limits.grpc.keepaliveInterval | quote }}
- name: MESHCA_KEEPALIVE_TIMEOUT
  value: {{ .Values.limits.grpc.keepaliveTimeout | quote }}
- name: MESHCA_MAX_CONNECTION_AGE
  value: {{ .Values.limits.grpc.maxConnectionAge | quote }}
- name: MESHCA_MAX_CONNECTION_AGE_GRACE
  value: {{ .Values.limits.grpc.maxConnectionAgeGrace | quote }}
- name: MESHCA_MAX_CANCELLED_STREAMS_PER_SECOND
  value: {{ .Values.limits.grpc.maxCancelledStreamsPerSecond | int64 | quote }}
- name: MESHCA_MAX_REQUEST_BYTES
  value: {{ .Values.limits.input.maxRequestBytes | int64 | quote }}
- name: MESHCA_MAX_TOKEN_BYTES
  value: {{ .Values.limits.input.maxTokenBytes | int64 | quote }}
- name: MESHCA_MAX_CLUSTER_ID_BYTES
  value: {{ .Values.limits.input.maxClusterIDBytes | int64 | quote }}
- name: MESHCA_MAX_METADATA_VALUE_BYTES
  value: {{ .Values.limits.input.maxMetadataValueBytes | int64 | quote }}
- name: MESHCA_MAX_METADATA_KEYS
  value: {{ .Values.limits.input.maxMetadataKeys | int64 | quote }}
- name: MESHCA_ADMIN_MAX_CONNECTIONS
  value: {{ .Values.limits.admin.maxConnections | int64 | quote }}
- name: MESHCA_ADMIN_HEADER_TIMEOUT
  value: {{ .Values.limits.admin.headerTimeout | quote }}
- name: MESHCA_ADMIN_CONNECTION_TIMEOUT
  value: {{ .Values.limits.admin.connectionTimeout | quote }}
- name: MESHCA_ADMIN_MAX_CONNECTIONS_PER_IP
  value: {{ .Values.limits.admin.maxConnectionsPerIP | int64 | quote }}
- name: MESHCA_MAX_INFLIGHT_REQUESTS_PER_IP
  value: {{ .Values.limits.grpc.maxInflightRequestsPerIP | int64 | quote }}
- name: MESHCA_MAX_PENDING_HANDSHAKES_PER_IP
  value: {{ .Values.limits.grpc.maxPendingHandshakesPerIP | int64 | quote }}
- name: MESHCA_ADMISSION_MAX_RUNNING
  value: {{ .Values.admission.maxRunning | int64 | quote }}
- name: MESHCA_ADMISSION_MAX_QUEUED
  value: {{ .Values.admission.maxQueued | int64 | quote }}
- name: MESHCA_ADMISSION_MAX_WAIT
  value: {{ .Values.admission.maxWait | quote }}
- name: MESHCA_ADMISSION_DEADLINE_MARGIN
  value: {{ .Values.admission.deadlineMargin | quote }}
- name: MESHCA_ADMISSION_PUSHBACK
  value: {{ .Values.admission.pushback | quote }}
- name: MESHCA_ADMISSION_NEW_CALLER_QPS_PER_IP
  value: {{ .Values.admission.newCallerQPSPerIP | int64 | quote }}
- name: MESHCA_ADMISSION_NEW_CALLER_BURST_PER_IP
  value: {{ .Values.admission.newCallerBurstPerIP | int64 | quote }}
- name: MESHCA_ADMISSION_LIFO_AFTER
  value: {{ .Values.admission.lifoAfter | quote }}
- name: MESHCA_ADMISSION_QUEUE_TARGET
  value: {{ .Values.admission.queueTarget | quote }}
- name: MESHCA_SIGNING_NICE
  value: {{ .Values.admission.signingNice | int64 | quote }}
- name: MESHCA_ADMISSION_SIGN_INLINE
  value: {{ .Values.admission.signInline | quote }}
- name: MESHCA_ADMISSION_MIN_STREAMS_PER_CONNECTION
  value: {{ .Values.admission.minStreamsPerConnection | int64 | quote }}
- name: MESHCA_ADMISSION_STREAM_PARK
  value: {{ .Values.admission.streamPark | quote }}
- name: MESHCA_IDENTITY_CAP
  value: {{ .Values.admission.identityCap | int64 | quote }}
- name: MESHCA_IDENTITY_CAP_WINDOW
  value: {{ .Values.admission.identityCapWindow | quote }}
{{- end }}
