{{/* Labels every resource of the release carries. */}}
{{- define "tangram.labels" -}}
app.kubernetes.io/name: tangram
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: {{ .Values.app.name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{- define "tangram.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag }}
{{- end }}

{{/* Where every Tangram container reaches Kafka, the registry, Redis (password by reference) and Triton.
     A container's identity (its Kafka principal, its registry user) comes from "tangram.identity". */}}
{{- define "tangram.env" -}}
- name: TANGRAM_HOST
  value: "0.0.0.0"
- name: TANGRAM_KAFKA_HOST
  value: {{ .Values.kafka.host | quote }}
- name: TANGRAM_KAFKA_PORT
  value: {{ .Values.kafka.port | quote }}
- name: TANGRAM_REGISTRY_HOST
  value: {{ printf "%s-schema-registry" .Release.Name }}
- name: TANGRAM_REGISTRY_PORT
  value: "8081"
- name: TANGRAM_REDIS_HOST
  value: {{ printf "%s-redis" .Release.Name }}
- name: TANGRAM_REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.existingSecret }}
      key: {{ .Values.redis.secretKey }}
- name: TANGRAM_TRITON_HOST
  value: {{ printf "%s-triton" .Release.Name }}
{{- end }}

{{/* A container's Kafka principal and registry user, every password by reference:
     (dict "root" $ "principal" NAME "registry" "reader"|"admin"). Mount "tangram.caVolume" beside it. */}}
{{- define "tangram.identity" -}}
{{- $root := .root }}
{{- if $root.Values.kafka.security.enabled }}
- name: TANGRAM_KAFKA_SECURITY__PROTOCOL
  value: SASL_SSL
- name: TANGRAM_KAFKA_SECURITY__MECHANISM
  value: {{ $root.Values.kafka.security.mechanism | quote }}
- name: TANGRAM_KAFKA_SECURITY__USERNAME
  value: {{ .principal | quote }}
- name: TANGRAM_KAFKA_SECURITY__PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .principal }}
      key: password
- name: TANGRAM_KAFKA_SECURITY__CA_FILE
  value: {{ printf "/etc/tangram/kafka-ca/%s" $root.Values.kafka.security.caKey | quote }}
{{- end }}
{{- $user := index $root.Values.schemaRegistry .registry }}
- name: TANGRAM_REGISTRY_USERNAME
  value: {{ $user.user | quote }}
- name: TANGRAM_REGISTRY_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $user.secret }}
      key: {{ $user.key }}
{{- end }}

{{/* The cluster CA every Kafka client trusts (Strimzi's Secret), as a volume and its mount. */}}
{{- define "tangram.caVolume" -}}
{{- if .Values.kafka.security.enabled }}
- name: kafka-ca
  secret:
    secretName: {{ .Values.kafka.security.caSecret }}
{{- end }}
{{- end }}

{{- define "tangram.caMount" -}}
{{- if .Values.kafka.security.enabled }}
- name: kafka-ca
  mountPath: /etc/tangram/kafka-ca
  readOnly: true
{{- end }}
{{- end }}

{{/* The fewest partitions among a processor's inputs: the most consumer-group members that get work. */}}
{{- define "tangram.partitionBound" -}}
{{- $root := index . 0 }}{{- $p := index . 1 }}
{{- $bound := 0 }}
{{- range $p.inputs }}
{{- $n := int (index $root.Values.topics .).partitions }}
{{- if or (eq $bound 0) (lt $n $bound) }}{{- $bound = $n }}{{- end }}
{{- end }}
{{- $bound }}
{{- end }}
