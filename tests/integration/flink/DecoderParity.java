package dev.tangram.flink;

import java.io.BufferedReader;
import java.io.ByteArrayInputStream;
import java.io.InputStreamReader;
import java.nio.charset.StandardCharsets;
import java.util.HexFormat;
import java.util.Map;

import org.apache.flink.api.common.serialization.DeserializationSchema;
import org.apache.flink.avro.registry.confluent.shaded.io.confluent.kafka.schemaregistry.client.CachedSchemaRegistryClient;
import org.apache.flink.formats.avro.registry.confluent.ConfluentSchemaRegistryCoder;
import org.apache.flink.table.data.RowData;
import org.apache.flink.table.types.logical.RowType;
import org.apache.flink.table.types.logical.utils.LogicalTypeParser;

/**
 * For {@code test_flink_decoder.py}: each value on stdin (hex, one a line) decoded by {@code CONFLUENT_AVRO} and by
 * Flink's avro-confluent deserializer alone, printed as {@code <reader>\t<function's row>\t<Flink's row>}, where
 * reader is {@code flat} when {@link FlatRecordDecoder} reads the value's writer schema, else {@code flink}.
 *
 * <pre>java -cp ... dev.tangram.flink.DecoderParity 'ROW<...>' http://registry &lt; values.hex</pre>
 */
public final class DecoderParity {
    public static void main(String[] args) throws Exception {
        String rowType = args[0];
        String registryUrl = args[1];
        RowType type = (RowType) LogicalTypeParser.parse(rowType, DecoderParity.class.getClassLoader());
        ConfluentSchemaRegistryCoder registry = new ConfluentSchemaRegistryCoder(
                new CachedSchemaRegistryClient(registryUrl, 100, Map.of()));
        ConfluentAvro function = new ConfluentAvro();
        DeserializationSchema<RowData> flink = ConfluentAvro.open(rowType, registryUrl);
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in, StandardCharsets.UTF_8));
        for (String line = in.readLine(); line != null; line = in.readLine()) {
            byte[] value = HexFormat.of().parseHex(line.strip());
            String reader = "flink";
            try {
                if (FlatRecordDecoder.plan(registry.readSchema(new ByteArrayInputStream(value, 0, 5)), type) != null) {
                    reader = "flat";
                }
            } catch (Exception e) {
                reader = "none"; // not framed, or a schema id the registry does not know
            }
            RowData expected;
            try {
                expected = flink.deserialize(value);
            } catch (Exception e) {
                expected = null;
            }
            System.out.println(reader + "\t" + function.eval(value, rowType, registryUrl) + "\t" + expected);
        }
    }
}
