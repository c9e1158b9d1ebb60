package dev.tangram.flink;

import java.io.ByteArrayInputStream;
import java.util.HashMap;
import java.util.HashSet;
import java.util.Map;
import java.util.Set;

import org.apache.flink.api.common.serialization.DeserializationSchema;
import org.apache.flink.avro.registry.confluent.shaded.io.confluent.kafka.schemaregistry.client.CachedSchemaRegistryClient;
import org.apache.flink.formats.avro.AvroRowDataDeserializationSchema;
import org.apache.flink.formats.avro.AvroToRowDataConverters;
import org.apache.flink.formats.avro.registry.confluent.ConfluentRegistryAvroDeserializationSchema;
import org.apache.flink.formats.avro.registry.confluent.ConfluentSchemaRegistryCoder;
import org.apache.flink.formats.avro.typeutils.AvroSchemaConverter;
import org.apache.flink.metrics.MetricGroup;
import org.apache.flink.metrics.groups.UnregisteredMetricsGroup;
import org.apache.flink.table.catalog.DataTypeFactory;
import org.apache.flink.table.data.RowData;
import org.apache.flink.table.functions.ScalarFunction;
import org.apache.flink.table.runtime.typeutils.InternalTypeInfo;
import org.apache.flink.table.types.DataType;
import org.apache.flink.table.types.inference.InputTypeStrategies;
import org.apache.flink.table.types.inference.TypeInference;
import org.apache.flink.table.types.logical.RowType;
import org.apache.flink.table.types.utils.TypeConversions;
import org.apache.flink.table.types.logical.utils.LogicalTypeParser;
import org.apache.flink.util.UserCodeClassLoader;

/**
 * {@code CONFLUENT_AVRO(value, 'ROW<field TYPE, ...>', 'http://registry')}: a Confluent-framed Avro value
 * decoded in the JVM by Flink's own avro-confluent format (the deserializer its {@code avro-confluent}
 * table format is made of: the writer schema fetched from the registry by the value's schema id, resolved
 * into the fields asked for), or NULL when the bytes are not such a value.
 *
 * <p>Why a function and not the format on the table: the job also needs the record's original bytes (a
 * late or undecodable reading goes to the dead-letter topic untouched), and a Kafka table has one value
 * format. So the table reads raw bytes and this decodes them.
 *
 * <p>A writer schema of primitive fields is read by {@link FlatRecordDecoder} (straight into the row, the same
 * values); any other by Flink's deserializer. Which one is decided once per schema id.
 */
public class ConfluentAvro extends ScalarFunction {

    private static final int CACHED_SCHEMAS = 1000;

    private transient DeserializationSchema<RowData> decoder;
    private transient ConfluentSchemaRegistryCoder registry;
    private transient RowType type;
    private transient Map<Integer, FlatRecordDecoder> flat; // writer schema id → its fast decoder
    private transient Set<Integer> general; // writer schema ids the fast decoder does not read
    /**
     * The last value decoded on this thread, its row type and row. The planner calls the function once per
     * field a query takes from it (and once more for the source's watermark), each call site an instance of
     * its own, all with the same bytes one after the other on the task's thread (with object reuse, the
     * source's array itself): those calls decode once.
     */
    private static final ThreadLocal<Object[]> LAST = ThreadLocal.withInitial(() -> new Object[3]);

    public RowData eval(byte[] value, String rowType, String registryUrl) {
        if (value == null) {
            return null;
        }
        Object[] last = LAST.get();
        if (last[0] == value && rowType.equals(last[1])) {
            return (RowData) last[2];
        }
        RowData row;
        try {
            row = decode(value, rowType, registryUrl);
        } catch (Exception e) {
            if (unreachable(e)) { // the registry is down, not the record bad: fail, the job restores and retries
                throw new IllegalStateException("schema registry " + registryUrl + " unreachable", e);
            }
            row = null; // not Confluent-framed Avro, an unknown schema id, fields that do not resolve
        }
        last[0] = value;
        last[1] = rowType;
        last[2] = row;
        return row;
    }

    private RowData decode(byte[] value, String rowType, String registryUrl) throws Exception {
        if (flat == null) {
            type = (RowType) LogicalTypeParser.parse(rowType, ConfluentAvro.class.getClassLoader());
            Map<String, String> config = registryConfig(registryUrl);
            registry = new ConfluentSchemaRegistryCoder(new CachedSchemaRegistryClient(withoutUserInfo(registryUrl),
                    CACHED_SCHEMAS, config == null ? Map.of() : config));
            flat = new HashMap<>();
            general = new HashSet<>();
        }
        if (value.length >= 5 && value[0] == 0) {
            int id = ((value[1] & 0xff) << 24) | ((value[2] & 0xff) << 16) | ((value[3] & 0xff) << 8) | (value[4] & 0xff);
            FlatRecordDecoder fast = flat.get(id);
            if (fast == null && !general.contains(id)) {
                fast = FlatRecordDecoder.plan(registry.readSchema(new ByteArrayInputStream(value, 0, 5)), type);
                if (fast == null) {
                    general.add(id);
                } else {
                    flat.put(id, fast);
                }
            }
            if (fast != null) {
                return fast.decode(value);
            }
        }
        if (decoder == null) {
            decoder = open(rowType, registryUrl);
        }
        return decoder.deserialize(value);
    }

    private static boolean unreachable(Throwable e) {
        for (Throwable t = e; t != null; t = t.getCause()) {
            if (t instanceof java.net.ConnectException || t instanceof java.net.SocketTimeoutException
                    || t instanceof java.net.UnknownHostException) {
                return true;
            }
        }
        return false;
    }

    static DeserializationSchema<RowData> open(String rowType, String registryUrl) {
        RowType type = (RowType) LogicalTypeParser.parse(rowType, ConfluentAvro.class.getClassLoader());
        DeserializationSchema<RowData> schema = new AvroRowDataDeserializationSchema(
                ConfluentRegistryAvroDeserializationSchema.forGeneric(AvroSchemaConverter.convertToSchema(type),
                        withoutUserInfo(registryUrl), registryConfig(registryUrl)),
                AvroToRowDataConverters.createRowConverter(type),
                InternalTypeInfo.of(type));
        try {
            schema.open(new Context());
        } catch (Exception e) {
            throw new IllegalStateException("cannot open the avro-confluent decoder of " + rowType, e);
        }
        return schema;
    }

    /** The registry URL without its {@code user:password@} part (sent as basic auth instead). */
    static String withoutUserInfo(String registryUrl) {
        java.net.URI uri = java.net.URI.create(registryUrl);
        if (uri.getRawUserInfo() == null) {
            return registryUrl;
        }
        return registryUrl.replace(uri.getRawUserInfo() + "@", "");
    }

    /** The registry client's basic auth from the URL's user info (percent-decoded), as Confluent's clients take it. */
    static java.util.Map<String, String> registryConfig(String registryUrl) {
        String userInfo = java.net.URI.create(registryUrl).getUserInfo();
        if (userInfo == null) {
            return null;
        }
        java.util.Map<String, String> config = new java.util.HashMap<>();
        config.put("basic.auth.credentials.source", "USER_INFO");
        config.put("basic.auth.user.info", userInfo);
        return config;
    }

    /** What the decoder's {@code open} asks of its runtime: no metrics, this class's loader. */
    private static final class Context implements DeserializationSchema.InitializationContext {
        @Override
        public MetricGroup getMetricGroup() {
            return new UnregisteredMetricsGroup();
        }

        @Override
        public UserCodeClassLoader getUserCodeClassLoader() {
            ClassLoader loader = ConfluentAvro.class.getClassLoader();
            return new UserCodeClassLoader() {
                @Override
                public ClassLoader asClassLoader() {
                    return loader;
                }

                @Override
                public void registerReleaseHookIfAbsent(String name, Runnable hook) {}
            };
        }
    }

    @Override
    public TypeInference getTypeInference(DataTypeFactory typeFactory) {
        return TypeInference.newBuilder()
                .inputTypeStrategy(InputTypeStrategies.sequence(
                        InputTypeStrategies.explicit(org.apache.flink.table.api.DataTypes.BYTES()),
                        InputTypeStrategies.and(InputTypeStrategies.LITERAL,
                                InputTypeStrategies.explicit(org.apache.flink.table.api.DataTypes.STRING())),
                        InputTypeStrategies.and(InputTypeStrategies.LITERAL,
                                InputTypeStrategies.explicit(org.apache.flink.table.api.DataTypes.STRING()))))
                .outputTypeStrategy(call -> call.getArgumentValue(1, String.class).map(text -> {
                    DataType row = TypeConversions.fromLogicalToDataType(
                            LogicalTypeParser.parse(text, ConfluentAvro.class.getClassLoader()));
                    return row.bridgedTo(RowData.class);
                }))
                .build();
    }

    @Override
    public boolean isDeterministic() {
        return true;
    }
}
