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

{{- define "meshca.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
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

{{/* The Secret holding the checkpoint key: the given one, else the one the chart generates. */}}
{{- define "meshca.checkpointSecret" -}}
{{- if .Values.audit.checkpoint.secretName -}}
{{ .Values.audit.checkpoint.secretName }}
{{- else if .Values.audit.checkpoint.generateKey -}}
{{ include "meshca.fullname" . }}-audit-checkpoint-key
{{- end -}}
{{- end }}

{{/* The ConfigMap holding each replica's anchored audit head. */}}
{{- define "meshca.anchorConfigMap" -}}
{{- default (printf "%s-audit-anchors" (include "meshca.fullname" .)) .Values.audit.anchor.configMapName -}}
{{- end }}
