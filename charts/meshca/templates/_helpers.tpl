{{/* Chart name, overridable. */}}
{{- define "meshca.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of every resource: the release name, with the chart name appended unless the
release name already contains it (so `helm install meshca` gives "meshca").
*/}}
{{- define "meshca.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Labels that select the pods; never change them after the first install. */}}
{{- define "meshca.selectorLabels" -}}
app.kubernetes.io/name: {{ include "meshca.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "meshca.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "meshca.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "meshca.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "meshca.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image reference, as cert-manager's istio-csr builds it: [<registry>/]<repository>, then
@<digest> when a digest is set (the tag is ignored), else :<tag> (default: the chart's appVersion).
*/}}
{{- define "meshca.image" -}}
{{- with .Values.image }}
{{- if .registry }}{{ printf "%s/%s" (trimSuffix "/" .registry) .repository }}{{ else }}{{ .repository }}{{ end }}
{{- if .digest }}{{ printf "@%s" .digest }}{{ else }}{{ printf ":%s" (default $.Chart.AppVersion .tag) }}{{ end }}
{{- end }}
{{- end }}

{{/* The names clients dial: the Service's in-cluster DNS names. */}}
{{- define "meshca.servingNames" -}}
{{- if .Values.servingNames }}
{{- join "," .Values.servingNames }}
{{- else }}
{{- $svc := printf "%s.%s.svc" (include "meshca.fullname" .) .Release.Namespace }}
{{- printf "%s,%s.cluster.local" $svc $svc }}
{{- end }}
{{- end }}

{{/* Where the checkpoint key Secret is mounted. */}}
{{- define "meshca.checkpointKeyDir" -}}
/etc/meshca/audit-checkpoint-key
{{- end }}

{{/* The Secret holding the checkpoint key when one is mounted (audit.checkpoint.secretName). */}}
{{- define "meshca.checkpointSecret" -}}
{{- .Values.audit.checkpoint.secretName -}}
{{- end }}

{{/* The Secret meshca creates with a new checkpoint key on its first start (generateKey). */}}
{{- define "meshca.generatedKeySecret" -}}
{{- if and .Values.audit.checkpoint.generateKey (not .Values.audit.checkpoint.secretName) -}}
{{ include "meshca.fullname" . }}-audit-checkpoint-key
{{- end -}}
{{- end }}

{{/* topologySpreadConstraints, an entry without a labelSelector given the pods' selector labels. */}}
{{- define "meshca.spreadConstraints" -}}
{{- $out := list }}
{{- range .Values.topologySpreadConstraints }}
{{- $c := deepCopy . }}
{{- if not (hasKey $c "labelSelector") }}
{{- $_ := set $c "labelSelector" (dict "matchLabels" (include "meshca.selectorLabels" $ | fromYaml)) }}
{{- end }}
{{- $out = append $out $c }}
{{- end }}
{{- toYaml $out }}
{{- end }}

{{/* The ConfigMap holding each replica's anchored audit head. */}}
{{- define "meshca.anchorConfigMap" -}}
{{- default (printf "%s-audit-anchors" (include "meshca.fullname" .)) .Values.audit.anchor.configMapName -}}
{{- end }}
