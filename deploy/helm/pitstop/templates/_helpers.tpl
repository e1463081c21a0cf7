{{/* Names, labels and the values several templates share. */}}

{{- define "pitstop.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pitstop.fullname" -}}
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

{{- define "pitstop.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "pitstop.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pitstop
{{- end }}

{{/* Selector labels of one component: include "pitstop.selector" (list . "scheduler") */}}
{{- define "pitstop.selector" -}}
{{- $root := index . 0 -}}
app.kubernetes.io/name: {{ include "pitstop.name" $root }}
app.kubernetes.io/instance: {{ $root.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "pitstop.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{- define "pitstop.schedulerName" -}}
{{ include "pitstop.fullname" . }}-scheduler
{{- end }}

{{- define "pitstop.nodeName" -}}
{{ include "pitstop.fullname" . }}-node
{{- end }}

{{/* host:port of the scheduler's API, as the nodes reach it (the Service; with
scheduler.ingest.replicas, the ingest replicas' Service: they hold the agent streams). */}}
{{- define "pitstop.schedulerAddress" -}}
{{ include "pitstop.schedulerName" . }}{{ if gt (int .Values.scheduler.ingest.replicas) 0 }}-ingest{{ end }}.{{ .Release.Namespace }}.svc:{{ .Values.scheduler.port }}
{{- end }}

{{/* True (non-empty) when the scheduler runs embedded PostgreSQL and Redis. */}}
{{- define "pitstop.embeddedStores" -}}
{{- if and (not .Values.stores.existingSecret) (not .Values.stores.databaseUrl) (not .Values.stores.redisUrl) }}true{{ end }}
{{- end }}

{{- define "pitstop.storesSecret" -}}
{{ .Values.stores.existingSecret | default (printf "%s-stores" (include "pitstop.fullname" .)) }}
{{- end }}

{{- define "pitstop.caSecret" -}}
{{ .Values.tls.caSecret | default (printf "%s-ca" (include "pitstop.fullname" .)) }}
{{- end }}

{{- define "pitstop.caCertConfigMap" -}}
{{ include "pitstop.fullname" . }}-ca-cert
{{- end }}

{{- define "pitstop.adminSecret" -}}
{{ include "pitstop.fullname" . }}-admin-token
{{- end }}

{{- define "pitstop.agentTokenSecret" -}}
{{ include "pitstop.fullname" . }}-agent-token
{{- end }}

{{- define "pitstop.joinSecret" -}}
{{ .Values.enrollment.secretName | default (printf "%s-join-tokens" (include "pitstop.fullname" .)) }}
{{- end }}

{{- define "pitstop.nodeServiceAccount" -}}
{{- if .Values.serviceAccount.create }}{{ include "pitstop.nodeName" . }}{{ else }}default{{ end }}
{{- end }}

{{- define "pitstop.schedulerServiceAccount" -}}
{{- if .Values.serviceAccount.create }}{{ include "pitstop.schedulerName" . }}{{ else }}default{{ end }}
{{- end }}

{{/* What the values cannot say in a schema: checked once, with the fix in the message. */}}
{{- define "pitstop.checks" -}}
{{- if and (not .Values.stores.existingSecret) (or .Values.stores.databaseUrl .Values.stores.redisUrl) (not (and .Values.stores.databaseUrl .Values.stores.redisUrl)) }}
{{- fail "stores: give both stores.databaseUrl and stores.redisUrl (or stores.existingSecret with the keys database-url and redis-url); one alone would run the other embedded in each scheduler pod" }}
{{- end }}
{{- if and (include "pitstop.embeddedStores" .) (gt (int .Values.scheduler.replicas) 1) }}
{{- fail (printf "scheduler.replicas: %d needs external PostgreSQL and Redis (stores.databaseUrl and stores.redisUrl, or stores.existingSecret): embedded servers belong to one pod, so the replicas would not share a leader lease or any state" (int .Values.scheduler.replicas)) }}
{{- end }}
{{- if and (include "pitstop.embeddedStores" .) (gt (int .Values.scheduler.ingest.replicas) 0) }}
{{- fail (printf "scheduler.ingest.replicas: %d needs external PostgreSQL and Redis (stores.databaseUrl and stores.redisUrl, or stores.existingSecret): the ingest replicas and the deciding ones share them" (int .Values.scheduler.ingest.replicas)) }}
{{- end }}
{{- if and .Values.tls.enabled .Values.tls.caSecret (not .Values.tls.caCert) }}
{{- fail "tls.caSecret is given without tls.caCert: give the CA's certificate (PEM, the Secret's ca.crt) too; the nodes need it to enroll, and must never mount the Secret with ca.key" }}
{{- end }}
{{- end }}
