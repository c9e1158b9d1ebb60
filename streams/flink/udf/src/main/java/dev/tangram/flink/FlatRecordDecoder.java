package dev.tangram.flink;

import java.io.IOException;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.avro.shaded.org.apache.avro.Schema;
import org.apache.flink.avro.shaded.org.apache.avro.io.BinaryDecoder;
import org.apache.flink.avro.shaded.org.apache.avro.io.DecoderFactory;
import org.apache.flink.avro.shaded.org.apache.avro.util.Utf8;
import org.apache.flink.table.data.GenericRowData;
import org.apache.flink.table.data.RowData;
import org.apache.flink.table.data.StringData;
import org.apache.flink.table.types.logical.LogicalTypeRoot;
import org.apache.flink.table.types.logical.RowType;

/**
 * A writer schema of primitive fields (each maybe in a union with null) read straight into the row the query
 * asks for: the Avro body's fields in the writer's order, those the row takes converted as Avro's schema
 * resolution would (int to long, float or double; long to float or double; float to double), the rest
 * skipped. What Flink's avro-confluent deserializer does for such a schema in two steps (a {@code GenericRecord}
 * through a resolving decoder, then a converter to {@code RowData}) in one, without the record between.
 *
 * <p>{@link #plan} returns null for every schema it does not read exactly as that deserializer would (nested
 * records, arrays, maps, enums, fixed, unions of more than a type and null, a row field missing from the writer
 * or of a type the writer's cannot resolve to): {@link ConfluentAvro} then uses the deserializer itself.
 */
final class FlatRecordDecoder {

    private enum Kind { BOOLEAN, INT, LONG, FLOAT, DOUBLE, STRING, BYTES }

    private final Kind[] kinds; // per writer field, in the writer's order
    private final int[] nullBranch; // per writer field: the union branch that is null, -1 when not a union
    private final int[] positions; // per writer field: its row position, -1 when the row does not take it
    private final LogicalTypeRoot[] targets; // per writer field: the row field's type (null when skipped)
    private final int arity;
    private BinaryDecoder reuse;

    private FlatRecordDecoder(Kind[] kinds, int[] nullBranch, int[] positions, LogicalTypeRoot[] targets, int arity) {
        this.kinds = kinds;
        this.nullBranch = nullBranch;
        this.positions = positions;
        this.targets = targets;
        this.arity = arity;
    }

    /** The decoder of {@code writer} into {@code row}, or null when the fast path does not apply to them. */
    static FlatRecordDecoder plan(Schema writer, RowType row) {
        if (writer.getType() != Schema.Type.RECORD) {
            return null;
        }
        Map<String, Integer> wanted = new HashMap<>();
        List<String> names = row.getFieldNames();
        for (int i = 0; i < names.size(); i++) {
            wanted.put(names.get(i), i);
        }
        List<Schema.Field> fields = writer.getFields();
        int n = fields.size();
        Kind[] kinds = new Kind[n];
        int[] nullBranch = new int[n];
        int[] positions = new int[n];
        LogicalTypeRoot[] targets = new LogicalTypeRoot[n];
        int found = 0;
        for (int i = 0; i < n; i++) {
            Schema type = fields.get(i).schema();
            nullBranch[i] = -1;
            if (type.getType() == Schema.Type.UNION) {
                List<Schema> branches = type.getTypes();
                if (branches.size() != 2) {
                    return null;
                }
                int nul = branches.get(0).getType() == Schema.Type.NULL ? 0
                        : branches.get(1).getType() == Schema.Type.NULL ? 1 : -1;
                if (nul < 0) {
                    return null;
                }
                nullBranch[i] = nul;
                type = branches.get(1 - nul);
            }
            kinds[i] = kind(type.getType());
            if (kinds[i] == null) {
                return null;
            }
            Integer position = wanted.get(fields.get(i).name());
            positions[i] = position == null ? -1 : position;
            if (position != null) {
                targets[i] = row.getTypeAt(position).getTypeRoot();
                if (!resolves(kinds[i], targets[i])) {
                    return null;
                }
                found++;
            }
        }
        return found == names.size() ? new FlatRecordDecoder(kinds, nullBranch, positions, targets, names.size()) : null;
    }

    private static Kind kind(Schema.Type type) {
        switch (type) {
            case BOOLEAN: return Kind.BOOLEAN;
            case INT: return Kind.INT;
            case LONG: return Kind.LONG;
            case FLOAT: return Kind.FLOAT;
            case DOUBLE: return Kind.DOUBLE;
            case STRING: return Kind.STRING;
            case BYTES: return Kind.BYTES;
            default: return null;
        }
    }

    /** Whether Avro resolves a writer value of {@code kind} to the row's type, by its promotions. */
    private static boolean resolves(Kind kind, LogicalTypeRoot target) {
        switch (target) {
            case BOOLEAN: return kind == Kind.BOOLEAN;
            case INTEGER: return kind == Kind.INT;
            case BIGINT: return kind == Kind.INT || kind == Kind.LONG;
            case FLOAT: return kind == Kind.INT || kind == Kind.LONG || kind == Kind.FLOAT;
            case DOUBLE: return kind == Kind.INT || kind == Kind.LONG || kind == Kind.FLOAT || kind == Kind.DOUBLE;
            case VARCHAR: return kind == Kind.STRING;
            default: return false;
        }
    }

    /** The row of a Confluent-framed value (5 header bytes, then the Avro body); malformed bytes raise. */
    RowData decode(byte[] value) throws IOException {
        BinaryDecoder in = reuse = DecoderFactory.get().binaryDecoder(value, 5, value.length - 5, reuse);
        GenericRowData row = new GenericRowData(arity);
        for (int i = 0; i < kinds.length; i++) {
            if (nullBranch[i] >= 0) {
                int branch = in.readIndex();
                if (branch == nullBranch[i]) {
                    continue; // null: nothing more on the wire, the row's field stays null
                }
                if (branch != 1 - nullBranch[i]) {
                    throw new IOException("union branch " + branch + " of a two-branch union");
                }
            }
            int position = positions[i];
            switch (kinds[i]) {
                case BOOLEAN: {
                    boolean v = in.readBoolean();
                    if (position >= 0) row.setField(position, v);
                    break;
                }
                case INT: {
                    int v = in.readInt();
                    if (position >= 0) row.setField(position, widen(v, targets[i]));
                    break;
                }
                case LONG: {
                    long v = in.readLong();
                    if (position >= 0) row.setField(position, widen(v, targets[i]));
                    break;
                }
                case FLOAT: {
                    float v = in.readFloat();
                    if (position >= 0) row.setField(position, targets[i] == LogicalTypeRoot.DOUBLE ? (Object) (double) v : (Object) v);
                    break;
                }
                case DOUBLE: {
                    double v = in.readDouble();
                    if (position >= 0) row.setField(position, v);
                    break;
                }
                case STRING:
                    if (position >= 0) {
                        // as Flink's converter makes it (from the Java string), so that bytes that are not UTF-8
                        // read the same on both paths
                        Utf8 text = in.readString(null);
                        row.setField(position, StringData.fromString(text.toString()));
                    } else {
                        in.skipString();
                    }
                    break;
                case BYTES:
                    in.skipBytes(); // never taken: no row type resolves from bytes (see resolves)
                    break;
            }
        }
        return row;
    }

    private static Object widen(long v, LogicalTypeRoot target) {
        switch (target) {
            case INTEGER: return (int) v;
            case BIGINT: return v;
            case FLOAT: return (float) v;
            default: return (double) v;
        }
    }
}
